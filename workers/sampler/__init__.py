"""The sampler's wing: one process that follows the policy weights, asks the trainer for work,
generates rollout groups and publishes them, and heartbeats what it does. Each room owns one job
and touches only what it names:

- sampler_command.py: `echo-rl sampler`, its arguments, and an edge sampler's config read from the broker;
- sampler.py: the process (Sampler) and its two loops (async and sequential mode): which room acts when;
- weights.py: the weights the engine runs: following the published versions (streams/weights.py
  downloads and verifies them) and swapping them in, between calls or, for partial rollouts,
  between chunks of one (the engine asks, through echo/engines/base.py's NewerWeights);
- work.py: asking the trainer for work (streams/grants.py), and the scheduler's standby;
- generation.py: a call's groups (single- and multi-turn), the sampler's rewards, publishing them
  (streams/rollouts.py), and the call's measured pace;
- heartbeat.py: the sampler's status in the run's registry (streams/registry.py), what it reads
  back (quarantined, the run finished), and its last word when it stops;
- ranks.py: an MLX model split over several processes (sampler.ranks): the other ranks, started
  here or on other boxes (`echo-rl rank`, sampler.hostfile), watched; a lost or hung one starts
  the sampler again.
Either way the trainer grants the work: a sampler generates nothing unasked.
"""
