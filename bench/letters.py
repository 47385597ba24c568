"""A bench-only task the tiny random model learns gradually from its first step: write the
letter the prompt names, eight times, with partial credit for every byte near it.

The prompt is a letter and a number that only makes problems many (the held-out tenth, chosen by
a hash of the prompt, then shares every letter with training). A completion's reward is the
mean over its first LENGTH bytes of max(0, 1 - |byte - letter| / SCALE). A random byte-level
model's samples score ~0.1, and the policy's expected reward rises from there as its samples
close in on the lowercase letters, smoothly, over tens of steps: what the controlled staleness
study (bench/parity.py --preset controlled) needs to tell modes apart. What it measures is how
fast the policy's distribution moves, not reading: one middle letter written whatever the prompt
asks scores ~0.9, so a greedy answer gets there within a few steps, and a run's held-out
curve is its samples' mean reward (`eval_samples`), not its greedy answers'.

    task.name = "bench.letters:Letters"
"""

from __future__ import annotations

import random
import string

from echo.config import ConfigError
from echo.tasks import GeneratedTask, Score

LENGTH = 8  # bytes scored
SCALE = 64  # bytes this far from the letter score 0


class Letters(GeneratedTask):
    name = "letters"

    def __init__(self, params: dict):
        if params:
            raise ConfigError(f"task.params: the letters task takes none (given {sorted(params)})")

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        letter = rng.choice(string.ascii_lowercase)
        return [{"role": "user", "content": f"{rng.randrange(10_000):04d} {letter}"}], letter

    def score(self, completion: str, prompt) -> Score:
        target, written = ord(prompt.answer), completion.encode("utf-8")[:LENGTH]
        reward = sum(max(0.0, 1 - abs(byte - target) / SCALE) for byte in written) / LENGTH
        return Score(reward, format_ok=True, correct=written == prompt.answer.encode() * LENGTH)
