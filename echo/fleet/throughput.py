"""A sampler's measured speed over its recent generation calls: the r_i and g_i of the capacity
model (echo/fleet/capacity.py). Pure, no I/O."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class Rates(NamedTuple):
    groups_per_s: float  # while generating: the sampler's capacity, not its share of the work
    tokens_per_s: float
    call_s: float  # mean seconds per call


KEEP_AT_LEAST = 3  # calls: an idle sampler (on standby) keeps the rates it was last measured at
KEEP_AT_MOST = 8


class CallWindow:
    """The calls that ended in the last `window_s` seconds, at least the last KEEP_AT_LEAST and
    at most the last KEEP_AT_MOST."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.calls: deque[tuple[float, float, int, int]] = deque()  # (ended at, seconds, groups, tokens)

    def add(self, ended_at: float, seconds: float, groups: int, tokens: int) -> None:
        self.calls.append((ended_at, seconds, groups, tokens))

    def rates(self, now: float) -> Rates:
        """Per second of generating over the calls kept: those that ended in the last window_s,
        at most the last KEEP_AT_MOST, so a sampler's first calls (loading, warming up, a swarm
        starting on shared cores: 5-20 s where later ones take 0.1-0.6 s) stop counting after a
        few typical ones, not a whole window later."""
        while len(self.calls) > KEEP_AT_LEAST and (self.calls[0][0] < now - self.window_s or len(self.calls) > KEEP_AT_MOST):
            self.calls.popleft()
        busy = sum(c[1] for c in self.calls)
        if not self.calls or busy <= 0:
            return Rates(0.0, 0.0, 0.0)
        return Rates(sum(c[2] for c in self.calls) / busy, sum(c[3] for c in self.calls) / busy, busy / len(self.calls))
