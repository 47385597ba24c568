"""Which rollouts the trainer may learn from, given their policy version. Pure logic."""

from __future__ import annotations

from enum import Enum


class Freshness(str, Enum):
    USE = "use"
    STALE = "stale"  # generated with a version older than the bound: acked, counted, not trained on
    FUTURE = "future"  # claims a version the trainer has not published: a broken or lying sampler


def freshness(rollout_version: int, current_version: int, max_staleness: int) -> Freshness:
    """A rollout is usable if current - max_staleness <= its version <= current.
    max_staleness = 0 is on-policy: only the trainer's current version is used."""
    if rollout_version > current_version:
        return Freshness.FUTURE
    if rollout_version < current_version - max_staleness:
        return Freshness.STALE
    return Freshness.USE
