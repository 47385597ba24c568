"""The weights the sampler's engine runs. streams/weights.py's WeightsFollower downloads and
verifies each published version; this room swaps the newest into the engine, between generation
calls or, for partial rollouts, between chunks of one (`between_chunks`, called from the engine's
thread: echo/engines/base.py's NewerWeights). It publishes nothing."""

from __future__ import annotations

import asyncio
import time

import structlog

from echo.engines.base import Engine
from echo.model.loading import base_model_digest
from echo.process.logs import bind_process
from echo.weights.shards import WeightsMismatch
from echo.wire.messages import WeightsAnnouncement
from echo.wire.names import Version
from streams.client import RunClient
from streams.weights import WeightsFollower

log = structlog.get_logger()

SYNCS_KEPT = 8


class EngineWeights:
    def __init__(self, run: RunClient, engine: Engine, model_name: str, throttle_s: float = 0.0):
        self.engine, self.throttle_s = engine, throttle_s
        self.follower = WeightsFollower(run, base_model_digest(model_name))
        self.running = Version(0, -1)  # what the engine runs
        self.refused = Version(0, -1)  # the newest weights the engine refused: not tried again, nor waited for
        self.syncs: dict[str, float] = {}  # its last SYNCS_KEPT versions: heard of to running

    @property
    def version(self) -> int:
        """The version the engine runs now; -1 before the first."""
        return self.running.version

    async def start(self) -> None:
        await self.follower.start()

    async def stop(self) -> None:
        await self.follower.stop()

    async def apply_newest(self, at_least: int = 0, term: int | None = None) -> None:
        """Swap in the newest downloaded weights, waiting for version `at_least` (of `term`)
        if needed. A generation in flight is not touched here: it swaps between its chunks
        (between_chunks), or not at all."""
        announcement, shards = await self.follower.wait_for(at_least, term)
        if announcement.term_version > max(self.running, self.refused):
            await asyncio.to_thread(self.load, announcement, shards)

    async def wait_newer(self) -> None:
        """Until weights newer than any the engine runs or refused are downloaded."""
        await self.follower.wait_newer(max(self.running, self.refused))

    def between_chunks(self) -> int | None:
        """Partial rollouts: called from the engine's thread between chunks of a generation. The
        newest downloaded weights of the term it began with, if newer: their version."""
        time.sleep(self.throttle_s)  # a slower machine, when asked: slower chunks too
        ready = self.follower.ready
        newest = max(self.running, self.refused)
        if ready is None or ready[0].term != self.running.term or ready[0].term_version <= newest:
            return None
        return self.version if self.load(*ready) else None

    def load(self, announcement: WeightsAnnouncement, shards: list[bytearray]) -> bool:
        """Swap `announcement`'s weights into the engine, off the event loop; False if it refused them."""
        started = time.perf_counter()
        try:
            self.engine.load_weights(shards)
        except WeightsMismatch as e:
            self.refused = announcement.term_version
            self.follower.failures["weights_mismatch"] += 1
            log.warning("weights.refused", version=announcement.version, reason=str(e))
            return False
        self.running = announcement.term_version
        bind_process(version=self.version)
        fetched = self.follower.fetch_s.get(announcement.term_version, 0.0)
        self.syncs = dict(list(self.syncs.items())[-SYNCS_KEPT + 1:])
        self.syncs[str(announcement.version)] = round(fetched + time.perf_counter() - started, 4)
        log.debug("weights.applied", version=self.version)
        return True
