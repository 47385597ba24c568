"""Tasks: where prompts come from and how a completion is scored. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from echo.config import TaskConfig


@dataclass(frozen=True)
class Prompt:
    index: int  # the same index gives the same prompt anywhere: the trainer re-derives it
    messages: list[dict]  # chat messages, ending with the user's turn
    answer: str  # ground truth, never shown to the model


@dataclass(frozen=True)
class Score:
    reward: float  # in [0, 1]
    format_ok: bool
    correct: bool


class Task(Protocol):
    name: str

    def prompt(self, index: int) -> Prompt:
        """The prompt at `index`: deterministic, so a sampler need send only the index and the
        trainer can look up the ground truth itself instead of trusting the sampler."""

    def score(self, completion: str, prompt: Prompt) -> Score: ...


def make_task(cfg: TaskConfig) -> Task:
    from echo.tasks.arithmetic import Arithmetic

    tasks = {"arithmetic": Arithmetic}
    return tasks[cfg.name](cfg)
