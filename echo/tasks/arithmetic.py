"""Integer addition and subtraction; the answer goes in <answer></answer> tags."""

from __future__ import annotations

import random
import re

from echo.config import TaskConfig
from echo.tasks import Prompt, Score

_INSTRUCTION = "What is {question}? Reply with only the number inside <answer></answer> tags."
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class Arithmetic:
    name = "arithmetic"

    def __init__(self, cfg: TaskConfig):
        self.max_operand = cfg.max_operand
        self.format_reward = cfg.format_reward

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(index)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice("+-")
        question = f"{a} {op} {b}"
        answer = a + b if op == "+" else a - b
        # One worked example shows the format; small models rarely find the tags on their own.
        messages = [
            {"role": "user", "content": _INSTRUCTION.format(question="3 + 4")},
            {"role": "assistant", "content": "<answer>7</answer>"},
            {"role": "user", "content": _INSTRUCTION.format(question=question)},
        ]
        return Prompt(index=index, messages=messages, answer=str(answer))

    def score(self, completion: str, prompt: Prompt) -> Score:
        found = _ANSWER.findall(completion)
        if not found:
            return Score(reward=0.0, format_ok=False, correct=False)
        correct = int(found[-1]) == int(prompt.answer)
        return Score(reward=1.0 if correct else self.format_reward, format_ok=True, correct=correct)
