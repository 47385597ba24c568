"""The operator's wing: the commands a person runs around a run, each its parser beside the code it
calls (workers/cli.py names the contract):

- up.py, swarm.py: `echo-rl up`, a local swarm (embedded nats-server, a trainer, N samplers), its
  evaluation and report at the end;
- relay.py: `echo-rl relay`, a site's leaf node mirroring a run's weights;
- secure.py: `echo-rl secure`, credentials and TLS for a secured broker (streams/secure.py);
- status.py, page.py: `echo-rl status`, a run read from the broker alone, in a terminal or as a
  live page;
- plan.py: `echo-rl plan`, which samplers to pay for (echo/fleet/capacity.py);
- evaluate.py, heldout.py: `echo-rl eval`, the base model and the last weights on held-out prompts;
- report.py, charts.py: `echo-rl report`, a run's metrics as one PNG;
- replay.py, retrain.py: `echo-rl replay`, a run's rollout stream read back, or trained again;
- quarantine.py: `echo-rl quarantine`, the samplers the trainer ignores, listed or lifted;
- edge_bundle.py, edge_main.py: the one-file edge sampler, built and started.
"""
