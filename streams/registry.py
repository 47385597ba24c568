"""Samplers' heartbeats in the run's state bucket: one key per sampler, rewritten every few
seconds, so anyone (the trainer, an operator) can see who runs which version and what failed."""

from __future__ import annotations

from nats.js.errors import NoKeysError

from echo.protocol import SAMPLER_STATUS_PREFIX, SamplerStatus, decode, encode
from streams.client import Run


async def put_status(run: Run, status: SamplerStatus) -> None:
    await run.state.put(SAMPLER_STATUS_PREFIX + status.sampler_id, encode(status))


async def read_statuses(run: Run) -> list[SamplerStatus]:
    try:
        keys = await run.state.keys()
    except NoKeysError:
        return []
    entries = [await run.state.get(k) for k in keys if k.startswith(SAMPLER_STATUS_PREFIX)]
    return [decode(SamplerStatus, e.value) for e in entries]
