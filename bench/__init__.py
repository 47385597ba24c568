"""Benchmarks: each writes its results as JSON under bench/results/."""

from echo import passive_openmp

passive_openmp()  # before anything imports torch
