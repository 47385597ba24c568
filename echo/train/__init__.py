"""The trainer's computation, free of I/O: one step, its loss, its files and what it shows.

learner.py      one GRPO optimizer step on a batch of groups
algorithms/     the loss: advantages, the clipped objective, rollout corrections
checkpoint.py   the trainer's files in the run directory
metrics.py      a step's metrics as the scalars trackers log, by documented names
diagnosis.py    why a run learns or not: a step's signal, the cause when it has none, samples
heldout.py      a policy's score on a task's held-out prompts
"""
