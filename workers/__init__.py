"""Runnable processes: the trainer, the samplers, and the local swarm launcher."""

from echo import passive_openmp

passive_openmp()  # before anything imports torch
