"""The trainer's quarantine: strikes against samplers and the list it follows.

Owns the strike count (forged log-probs, claimed rewards) and this process's copy of the
quarantined samplers, kept in KV (streams/quarantine.py) where an operator lifts it (`echo-rl
quarantine lift`). The intake strikes; the intake and the granter ask who is quarantined.
"""

from __future__ import annotations

from collections import Counter

import structlog

from streams.client import Run, retry_forever
from streams.quarantine import change_quarantine, read_quarantine, watch_quarantine
from workers.background import Background

log = structlog.get_logger()


class Quarantined:
    """Samplers whose groups are acked and ignored and who are granted no work: caught forging
    log-probs or claiming rewards more than `trainer.quarantine_after` times. The trainer
    follows the key, so an operator's lift takes effect at once."""

    def __init__(self, run: Run, after: int):
        self.run, self.after = run, after
        self.samplers: dict[str, str] = {}
        self.strikes: Counter[str] = Counter()

    async def start(self, background: Background) -> None:
        self.samplers = await read_quarantine(self.run)
        background.start(watch_quarantine(self.run, self._changed))

    def _changed(self, samplers: dict[str, str]) -> None:
        for lifted in self.samplers.keys() - samplers.keys():
            self.strikes.pop(lifted, None)  # a fresh start
        self.samplers = samplers

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self.samplers

    async def strike(self, sampler_id: str, reason: str) -> None:
        self.strikes[sampler_id] += 1
        if self.strikes[sampler_id] > self.after and sampler_id not in self.samplers:
            why = f"{self.strikes[sampler_id]} strikes, the last {reason}"
            self.samplers[sampler_id] = why
            await retry_forever("quarantine", lambda: change_quarantine(
                self.run, lambda samplers: samplers.update({sampler_id: why})))
            log.warning("sampler.quarantined", sampler=sampler_id, why=why)
