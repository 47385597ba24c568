"""A bench-only task the tiny random model learns gradually from its first step: write the
letter the prompt names, eight times, with partial credit for every byte near it.

The prompt is a letter and a number that only makes problems many (the held-out tenth, chosen by
a hash of the prompt, then shares every letter with training). A completion's reward is the
mean over its first LENGTH bytes of max(0, 1 - |byte - letter| / SCALE): a random byte-level
model scores ~0.1, a model that writes lowercase letters whatever it is asked ~0.6, and only one
that reads its prompt reaches 1. So a curve rises from step 0 with no cliff: what the controlled
staleness study (bench/parity.py --preset controlled) needs to tell modes apart in ~100 steps.

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
