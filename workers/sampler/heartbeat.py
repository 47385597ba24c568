"""The sampler's heartbeat: its status in the run's registry (streams/registry.py) every
`sampler.heartbeat_s`, which the trainer reads to release a dead sampler's slots and the
scheduler to measure it, and what it reads back: whether the trainer quarantined it and whether
the run has finished. A beat the broker misses is logged and the next one tried."""

from __future__ import annotations

import asyncio
import time

import structlog

from echo.config import EchoConfig
from echo.wire.messages import SamplerStatus
from streams.client import BROKER_ERRORS, RunClient
from streams.quarantine import read_quarantine
from streams.registry import put_status, read_finished
from workers.sampler.generation import Generation
from workers.sampler.ranks import group_restarts
from workers.sampler.weights import EngineWeights
from workers.sampler.work import Work

log = structlog.get_logger()


class Heartbeat:
    def __init__(self, cfg: EchoConfig, sampler_id: str, run: RunClient, weights: EngineWeights, generation: Generation,
                 work: Work):
        self.cfg, self.sampler_id, self.run, self.engine = cfg, sampler_id, run, weights.engine
        self.weights, self.generation, self.work = weights, generation, work
        self.relay = ""  # the relay's JetStream domain, if it reads weights from one
        self.quarantined = False  # the trainer ignores this sampler's groups
        self.finished = False  # the trainer said the run has finished
        self.draining = False  # stopping: its last heartbeat says so
        self.said_version = -1  # the version its last heartbeat named

    def status(self) -> SamplerStatus:
        rates = self.generation.calls.rates(time.monotonic())
        scfg = self.cfg.sampler
        restarted, lost = group_restarts()
        return SamplerStatus(
            sampler_id=self.sampler_id,
            version=self.weights.version,
            groups_published=self.generation.published,
            weight_failures=dict(self.weights.follower.failures),
            updated_at=time.time(),
            state="draining" if self.draining else "quarantined" if self.quarantined else
            "finished" if self.finished else "standby" if self.work.standby else "active",
            ttl_s=scfg.entry_ttl_s,
            engine=self.engine.name,
            device=str(self.engine.device),
            model=self.cfg.model.name,
            relay=self.relay,
            cost_per_hour=scfg.cost_per_hour,
            groups_per_s=round(rates.groups_per_s, 4),
            tokens_per_s=round(rates.tokens_per_s, 2),
            call_s=round(rates.call_s, 4),
            sync_s=self.weights.syncs,
            process=self.work.process,
            ranks=scfg.ranks,
            ranks_restarted=restarted,
            rank_lost=lost,
        )

    async def beat(self) -> None:
        self.quarantined = self.sampler_id in await read_quarantine(self.run)
        if self.quarantined:
            log.warning("sampler.quarantined", sampler=self.sampler_id, lift="echo-rl quarantine lift")
        # Not the trainer's status: its tables by sampler made each beat's read grow with the fleet.
        finished_at = await read_finished(self.run)  # until a trainer takes the run further
        finished = finished_at is not None
        if finished and not self.finished:
            log.info("sampler.run_finished", step=finished_at, waiting="in case the run goes on: stop this "
                     "sampler when it is done with")
        self.finished = finished
        status = self.status()
        await put_status(self.run, status)
        self.said_version = status.version

    async def first_weights(self) -> None:
        """A beat as soon as the engine runs its first weights: the trainer's first steps read
        each sampler's version lag and sync time from it, not a beat heartbeat_s later."""
        if self.said_version < 0 <= self.weights.version:
            await self.try_beat()

    async def try_beat(self) -> None:
        """A beat the broker misses (restarting, unreachable) is logged and the next one tried;
        any other error ends the sampler, whose process then exits non-zero."""
        try:
            await self.beat()
        except BROKER_ERRORS as e:
            log.warning("sampler.heartbeat_failed", reason=repr(e))

    async def beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sampler.heartbeat_s)
            await self.try_beat()

    async def last_beat(self) -> None:
        """Stopping: the last word, what it did in total, its state draining."""
        self.draining = True
        try:
            await self.beat()
        except BROKER_ERRORS as e:
            log.warning("sampler.last_heartbeat_failed", reason=repr(e))
