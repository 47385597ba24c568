"""echo-rl: RL post-training with rollout generation and training on separate machines."""

import os


def passive_openmp() -> None:
    """torch's OpenMP threads spin while they wait for work (libgomp's default, ACTIVE): beside
    anything else busy on the box (a sampler beside the trainer, another job) they spin against it.
    32 tokens from the tiny model in a batch of 2 took 16 s instead of 0.09 s beside one busy
    process, an end-to-end test 300 s instead of 77 s. OpenMP reads OMP_WAIT_POLICY once, when
    torch loads it: every process of ours imports echo first (workers/cli.py, and the bench and tests
    packages ask; tests/test_layers.py checks), and child processes inherit it. A user's own stands."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


passive_openmp()
