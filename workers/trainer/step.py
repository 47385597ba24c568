"""One trainer step as it goes through its phases: the one object every phase reads and writes
(as verl's `fit` hands one batch along), timed phase by phase by the step itself.

The phases, in order: collect (ask for groups, judge what arrives), train, checkpoint (the step,
what it consumed and trained, and its record), publish (the new version), account (ack the
step's groups, count every message, write the step's metrics), and every run.eval_every steps
evaluate (the version just published, on held-out prompts). The order is the exactly-once
guarantee: groups are acked only after the checkpoint that holds their step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from echo.train.learner import Batch
from echo.wire.messages import WeightsAnnouncement
from workers.trainer.intake import Collected

PHASES = ("collect", "train", "checkpoint", "publish", "account", "evaluate")


@dataclass
class TrainerStep:
    number: int
    process_started: float  # perf_counter at the trainer process's start
    started: float = field(default_factory=time.perf_counter)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # each ended phase's (began, ended)
    collected: Collected = field(default_factory=Collected)  # every message the step consumed, judged
    batch: Batch | None = None  # what it trains on: the accepted groups and the trainer's rewards
    stats: dict = field(default_factory=dict)  # the learner's: loss, reward, KL, tokens, ...
    record: dict = field(default_factory=dict)  # the metrics line, checkpointed with the step
    published: WeightsAnnouncement | None = None  # the version it made, as announced
    samples: list[dict] = field(default_factory=list)  # completions to show (accounting.py's step_samples)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        assert name in PHASES and name not in self.spans, name
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spans[name] = (began, time.perf_counter())

    @property
    def seconds(self) -> dict[str, float]:
        """Each ended phase's duration."""
        return {name: ended - began for name, (began, ended) in self.spans.items()}

    def ended(self, name: str) -> float:
        """perf_counter at the end of phase `name`."""
        return self.spans[name][1]

    def busy_seconds(self) -> float:
        """Since its groups were in, to now: everything but the wait (T of the capacity model,
        echo/fleet/capacity.py)."""
        return time.perf_counter() - self.ended("collect")
