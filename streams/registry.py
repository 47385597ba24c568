"""Samplers' heartbeats in the run's state bucket: one key per sampler, rewritten every few
seconds, so anyone (the trainer, an operator) can see who runs which version and what failed."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError

from echo.protocol import SAMPLER_STATUS_PREFIX, SamplerStatus, decode, encode
from streams.client import Run


async def put_status(run: Run, status: SamplerStatus) -> None:
    await run.state.put(SAMPLER_STATUS_PREFIX + status.sampler_id, encode(status))


async def read_statuses(run: Run) -> list[SamplerStatus]:
    # The bucket's stream lists its subjects exactly. nats-py's `keys()` watches the bucket
    # instead and can stop before the first key arrives (its end marker races the delivery).
    prefix = f"$KV.{run.names.state_bucket}."
    info = await run.js.stream_info(f"KV_{run.names.state_bucket}", subjects_filter=prefix + SAMPLER_STATUS_PREFIX + ">")
    statuses = []
    for subject in sorted(info.state.subjects or {}):
        try:
            statuses.append(decode(SamplerStatus, (await run.state.get(subject.removeprefix(prefix))).value))
        except KeyNotFoundError:  # deleted
            continue
    return statuses


async def heartbeat_revision(run: Run, sampler_id: str) -> int:
    """The revision of the sampler's heartbeat key (0: none yet): it changes with every beat."""
    try:
        return (await run.state.get(SAMPLER_STATUS_PREFIX + sampler_id)).revision
    except KeyNotFoundError:
        return 0
