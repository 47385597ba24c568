"""How the trainer publishes a version: its shards written to the run directory, then sent
whole or, in full-weight mode, as deltas against the version before (echo/weights/delta.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from echo.config import EchoConfig
from echo.process.logs import bind_process
from echo.weights.delta import DeltaError, send_whole
from echo.weights.digest import files_digest
from echo.weights.files import delta_shards, weights_at
from echo.wire.messages import WeightsAnnouncement, WeightsLink
from streams.client import retry_forever
from streams.weights import WeightsPublisher
from workers.trainer.model import TrainerModel

log = structlog.get_logger()

PUBLISH_RETRY_MAX_S = 1.0  # the learner waits on a weights publish: try again soon after a failover


async def publish_version(weights: WeightsPublisher, model: TrainerModel, version: int) -> WeightsAnnouncement:
    """Write the version's shards to the run directory (for `echo-rl eval`), then publish them
    from there (a retry reads them again), or full weights as deltas against the version before.
    Both keep the newest `trainer.keep_versions` versions (the bucket, for `trainer.keep_versions_s`
    more: what a slow sampler's fetch may take; and whatever the newest delta is built from)."""
    files = await asyncio.to_thread(model.write_weights, version)
    digest, deltas = "", None  # a LoRA adapter goes whole, as published
    if model.kind == "full":
        digest, deltas = await asyncio.to_thread(as_delta, model.cfg, version, files, weights.chain)
    delta_of = weights.newest.version if deltas is not None else None
    announcement = await retry_forever("publish weights", lambda: weights.publish(
        version, deltas if deltas is not None else (f.read_bytes() for f in files), model.base_model, model.kind,
        digest=digest, delta_of=delta_of), max_delay_s=PUBLISH_RETRY_MAX_S)
    await asyncio.to_thread(model.remember, version)
    bind_process(version=version)  # this trainer's log lines name the version it last published
    return announcement


def as_delta(cfg: EchoConfig, version: int, files: list[Path],
             chain: list[WeightsLink]) -> tuple[str, list[bytes] | None]:
    """The digest of the full weights in `files`, and their shards as deltas against the
    last version of `chain` (the versions announced since the last whole one), or None when it
    goes whole: the first this trainer publishes, every `trainer.delta_every`, or a delta
    larger than `trainer.delta_max_share` of the whole."""
    tcfg = cfg.trainer
    digest, whole = files_digest(files), sum(f.stat().st_size for f in files)
    anchor = chain[0].version if chain else None

    def goes_whole(delta_bytes: int) -> bool:
        return send_whole(version, anchor, delta_bytes, whole, tcfg.delta_every, tcfg.delta_max_share)

    if tcfg.delta_every == 0 or goes_whole(0):  # whatever its size: an anchor is due
        return digest, None
    try:
        deltas = delta_shards(weights_at(cfg.run_dir, chain[-1].version), files, tcfg.delta_max_share * whole)
    except (DeltaError, FileNotFoundError) as e:  # sharded otherwise since, or deleted by hand
        log.info("weights.whole", version=version, reason=str(e))
        return digest, None
    if deltas is None or goes_whole(sum(map(len, deltas))):
        return digest, None
    return digest, deltas

