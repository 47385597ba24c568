"""The loss: GRPO's advantages, clipped objective and KL estimators (grpo.py), and the rollout
corrections for sampling with other weights than the learner's (corrections.py)."""
