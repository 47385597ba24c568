"""Async mode's admission budget: how many groups samplers may generate so that none arrives
stale. Pure arithmetic; streams/admission.py keeps the numbers in KV.

Leases are numbered 1, 2, 3, ... in the order samplers take them, and the trainer consumes groups
roughly in that order, B = groups_per_step per step. A group leased as number n is consumed by
step ceil(n / B) (plus the groups lost on the way). Generated with version w, it is fresh at that
step if ceil(n / B) - 1 <= w + S. So a sampler running version w may take lease n only while
n <= (w + S + 1) * B + lost. The trainer publishes that number for its own version v; a sampler
still running an older w shifts it down by (v - w) * B.

The trainer alone grants leases (GrantLedger), and no sampler may hold more than its share of
the groups that may be in flight: one that takes work and never delivers (dead or malicious)
blocks its share, never the whole window.
"""

from __future__ import annotations

import math
from collections import Counter

ACTIVE_S = 30.0  # a sampler that asked for work this recently shares the window


def allowance(version: int, max_staleness: int, groups_per_step: int, lost: int) -> int:
    """The highest lease number a sampler running `version` may take."""
    return (version + max_staleness + 1) * groups_per_step + lost


def sampler_cap(budget_version: int, budget_allowance: int, sampler_version: int, groups_per_step: int) -> int:
    """The allowance for a sampler whose weights are at `sampler_version`."""
    return budget_allowance - (budget_version - sampler_version) * groups_per_step


class GrantLedger:
    """How many granted groups each sampler holds (granted, not yet seen by the trainer)."""

    def __init__(self, active_s: float = ACTIVE_S):
        self.active_s = active_s
        self.held: Counter[str] = Counter()
        self.asked_at: dict[str, float] = {}

    def share(self, window: int, now: float) -> int:
        """The most one sampler may hold: an equal part of `window` among those asking."""
        active = sum(1 for asked in self.asked_at.values() if now - asked <= self.active_s)
        return math.ceil(window / max(1, active))

    def grant(self, sampler_id: str, want: int, headroom: int, window: int, now: float) -> tuple[int, bool]:
        """Grant `sampler_id` up to `want` groups of the `headroom` left, within its share.
        Returns (groups, whether headroom is left after them)."""
        self.asked_at[sampler_id] = now
        # Scarce headroom is split too: a sampler that always asks first must not take it all.
        headroom_share = self.share(headroom, now) if headroom > 0 else 0
        groups = max(0, min(want, headroom_share, self.share(window, now) - self.held[sampler_id]))
        self.held[sampler_id] += groups
        return groups, headroom > groups

    def delivered(self, sampler_id: str) -> None:
        if self.held[sampler_id] > 0:  # a group granted by the trainer's previous incarnation is not held
            self.held[sampler_id] -= 1

    def forget_held(self) -> None:
        """The trainer presumes what is held lost (nothing arrived for a while) and asks again."""
        self.held.clear()
