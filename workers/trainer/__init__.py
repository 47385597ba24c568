"""The trainer's wing: one process (rank 0 of several under torchrun) that consumes rollout
groups, takes GRPO steps and publishes each new version. Each room owns one job and touches only
what it names:

- trainer_command.py: `echo-rl trainer`, its arguments (under torchrun: each rank's);
- trainer.py: the process (Trainer) and its step loop, each step's phases named and timed (collect, train,
  checkpoint, publish, account, evaluate); it owns the order of the phases and nothing else;
- rooms.py: the rooms below, opened once from the run's config and checkpoint before the first
  step;
- intake.py: what becomes of every rollout message, through the rollout inbox
  (streams/inbox.py): decoded, handed to the judge, its verdict tallied, its grant ended, its
  sender struck; it publishes nothing;
- judge.py: the judging room: whether a group is trained, by one ordered list of checks (well
  formed, new, fresh, on its slot, scored, proven), each answering with a Verdict or none; it
  decides and counts nothing;
- scoring.py: the task's verifiers in a child process the trainer can kill, with a budget per
  completion; it sees groups, not the broker;
- granter.py: asking the samplers for groups and granting them the work (streams/grants.py,
  streams/pull.py); it reads no rollouts;
- holders.py: the samplers holding slots, watched by their heartbeats (streams/registry.py):
  joined, gone or stalled, their slots released for the granter to hand out again;
- publishing.py: a version written to the run directory and published, whole or as deltas
  (full weights) against the one before;
- strikes.py: strikes against samplers, and who is quarantined (streams/quarantine.py);
- accounting.py: the step's metrics, the run's totals, the learner's pace, its sample
  completions; bookkeeping only;
- shown.py: what a step shows outside: metrics.jsonl and the log, sample completions, the
  no-signal warning and its cause, the trackers' scalars; it decides nothing;
- evaluation.py: the version just published scored on held-out prompts (run.eval_every);
- coordinator.py: ECHO-2's cost-aware activation of samplers (scheduler.enabled);
- model.py: the model, its optimizer and checkpoint, on one rank or several; no NATS.
"""
