"""echo-rl: RL post-training with rollout generation and training on separate machines."""
