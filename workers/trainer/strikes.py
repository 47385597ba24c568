"""The trainer's quarantine: strikes against samplers and the list it follows.

Owns the strike count (forged log-probs, claimed rewards) and the suspects (caught forging once:
the proof checks all their groups), both kept in KV after every strike and read back at start, so
a restarted trainer gives no credential its budget back; and this process's copy of the
quarantined samplers, kept in KV (streams/quarantine.py) where an operator lifts it (`echo-rl
quarantine lift`). The intake strikes; the intake and the granter ask who is quarantined.
"""

from __future__ import annotations

from collections import Counter

import structlog

from echo.trust.proof import FORGERIES
from echo.wire.messages import Strikes
from streams.client import RunClient, retry_forever
from streams.quarantine import change_quarantine, put_strikes, read_quarantine, read_strikes, watch_quarantine
from workers.background import Background

log = structlog.get_logger()


class Quarantined:
    """Samplers whose groups are acked and ignored and who are granted no work: caught forging
    log-probs or claiming rewards more than `trainer.quarantine_after` times. The trainer
    follows the key, so an operator's lift takes effect within a second (streams/watch.py RARELY_S)."""

    def __init__(self, run: RunClient, after: int):
        self.run, self.after = run, after
        self.samplers: dict[str, str] = {}
        self.strikes: Counter[str] = Counter()
        self.suspects: set[str] = set()  # caught forging: every group of theirs is proven

    async def start(self, background: Background) -> None:
        self.samplers = await read_quarantine(self.run)
        kept = await read_strikes(self.run)  # a predecessor's
        self.strikes, self.suspects = Counter(kept.counts), set(kept.suspects)
        background.start(watch_quarantine(self.run, self._changed))

    def _changed(self, samplers: dict[str, str]) -> None:
        for lifted in self.samplers.keys() - samplers.keys():
            self.strikes.pop(lifted, None)  # a fresh start (the lift cleared the kept record)
            self.suspects.discard(lifted)
        self.samplers = samplers

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self.samplers

    async def strike(self, sampler_id: str, reason: str) -> None:
        self.strikes[sampler_id] += 1
        if reason in FORGERIES:
            self.suspects.add(sampler_id)
        kept = Strikes(counts=dict(self.strikes), suspects=sorted(self.suspects))
        await retry_forever("strikes", lambda: put_strikes(self.run, kept))
        if self.strikes[sampler_id] > self.after and sampler_id not in self.samplers:
            why = f"{self.strikes[sampler_id]} strikes, the last {reason}"
            self.samplers[sampler_id] = why
            await retry_forever("quarantine", lambda: change_quarantine(
                self.run, lambda samplers: samplers.update({sampler_id: why})))
            log.warning("sampler.quarantined", sampler=sampler_id, why=why)
