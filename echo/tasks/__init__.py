"""Tasks: where prompts come from and how a completion is scored. Pure, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from echo.config import TaskConfig


@dataclass(frozen=True)
class Prompt:
    id: str  # stable for the same problem, so a group can be traced and re-scored
    messages: list[dict]  # chat messages, ending with the user's turn
    answer: str  # ground truth, never shown to the model


@dataclass(frozen=True)
class Score:
    reward: float  # in [0, 1]
    format_ok: bool
    correct: bool


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Prompt: ...

    def score(self, completion: str, prompt: Prompt) -> Score: ...


def make_task(cfg: TaskConfig) -> Task:
    from echo.tasks.arithmetic import Arithmetic

    tasks = {"arithmetic": Arithmetic}
    return tasks[cfg.name](cfg)
