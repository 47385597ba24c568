"""Runnable processes: the trainer, the samplers, and the local swarm launcher."""
