"""Async mode's admission budget: how many groups samplers may generate so that none arrives
stale. Pure arithmetic; streams/admission.py keeps the numbers in KV.

Leases are numbered 1, 2, 3, ... in the order samplers take them, and the trainer consumes groups
roughly in that order, B = groups_per_step per step. A group leased as number n is consumed by
step ceil(n / B) (plus the groups lost on the way). Generated with version w, it is fresh at that
step if ceil(n / B) - 1 <= w + S. So a sampler running version w may take lease n only while
n <= (w + S + 1) * B + lost. The trainer publishes that number for its own version v; a sampler
still running an older w shifts it down by (v - w) * B.
"""

from __future__ import annotations


def allowance(version: int, max_staleness: int, groups_per_step: int, lost: int) -> int:
    """The highest lease number a sampler running `version` may take."""
    return (version + max_staleness + 1) * groups_per_step + lost


def sampler_cap(budget_version: int, budget_allowance: int, sampler_version: int, groups_per_step: int) -> int:
    """The allowance for a sampler whose weights are at `sampler_version`."""
    return budget_allowance - (budget_version - sampler_version) * groups_per_step
