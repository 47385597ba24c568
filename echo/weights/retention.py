"""Which published weight versions may leave the weights bucket. Pure logic.

A version goes once `keep` newer ones exist and a newer one was announced at least
`keep_seconds` ago. The count bounds the bucket; the time is what a sampler on a slow link needs:
counted in steps alone, a fetch longer than `keep` steps would never finish (each version it
starts is deleted under it), however long the trainer waits. A version the newest one is built
from (full weights sent as deltas: the anchor and the chain after it) stays whatever its age.
"""

from __future__ import annotations


def expired_versions(superseded_at: dict[int, float], newest: int, keep: int, keep_seconds: float,
                     now: float, needed: frozenset[int] = frozenset()) -> list[int]:
    """The versions of `superseded_at` (version -> when a newer one was announced) to delete
    now that `newest` is announced, oldest first; never one of `needed` (newest's chain)."""
    return sorted(v for v, at in superseded_at.items()
                  if v <= newest - keep and now - at >= keep_seconds and v not in needed)
