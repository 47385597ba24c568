"""The run's registry of samplers: each sampler's heartbeat (SamplerStatus) is one key of the
run's registry bucket (its sampler id), rewritten every few seconds with a per-key TTL, so anyone (the trainer, the
scheduler, an operator) can see who runs what, how fast and at what cost, and a dead sampler's
entry expires by itself."""

from __future__ import annotations

import functools
import time

import structlog
from pydantic import ValidationError

from echo.wire.codec import ProtocolError, decode, encode
from echo.wire.messages import SamplerStatus, TrainerStatus
from echo.wire.names import FINISHED_KEY, STATUS_MAX_BYTES, TRAINER_STATUS_KEY
from streams.client import RunClient, put_expiring
from streams.watch import read_value, read_values

log = structlog.get_logger()

def _decode_status(data: bytes) -> SamplerStatus:
    """A heartbeat, its size checked before it is decoded (the broker refuses larger ones in a run
    whose trainer created or updated the bucket; a reader does not count on it)."""
    if len(data) > STATUS_MAX_BYTES:
        raise ProtocolError("too_large", f"a heartbeat of {len(data)} bytes (at most {STATUS_MAX_BYTES})")
    return decode(SamplerStatus, data)


async def put_status(run: RunClient, status: SamplerStatus) -> None:
    await put_expiring(run.registry, status.sampler_id, encode(status), status.ttl_s)


async def put_trainer_status(run: RunClient, status: TrainerStatus) -> None:
    await run.state.put(TRAINER_STATUS_KEY, encode(status))


async def read_trainer_status(run: RunClient) -> TrainerStatus | None:
    """None before the trainer's first step."""
    return (await read_value(run.state, TRAINER_STATUS_KEY, functools.partial(decode, TrainerStatus)))[0]


async def put_finished(run: RunClient, step: int) -> None:
    await run.state.put(FINISHED_KEY, str(step).encode())


async def clear_finished(run: RunClient) -> None:
    """A trainer taking the run further: it has not finished."""
    await run.state.delete(FINISHED_KEY)


async def read_finished(run: RunClient) -> int | None:
    """The step the run finished at; None while it runs (or its trainer predates schema 30)."""
    return (await read_value(run.state, FINISHED_KEY, int))[0]


def weights_relay(run: RunClient, hub_domain: str) -> str:
    """The JetStream domain of the relay this client reads weights from; "" on the hub itself.
    The server's INFO says it when the client connects (nats-py keeps it private; a sampler may
    not ask JetStream for its account INFO)."""
    domain = (run.weights_nc or run.nc)._server_info.get("domain", "")
    return "" if domain == hub_domain else domain


async def read_statuses(run: RunClient) -> list[SamplerStatus]:
    # The bucket's stream lists its subjects exactly. nats-py's `keys()` watches the bucket
    # instead and can stop before the first key arrives (its end marker races the delivery).
    prefix = f"$KV.{run.names.registry_bucket}."
    info = await run.js.stream_info(f"KV_{run.names.registry_bucket}", subjects_filter=prefix + ">")
    keys = [subject.removeprefix(prefix) for subject in sorted(info.state.subjects or {})]
    values = await read_values(run.registry, keys, _decode_status)  # 1,000 read one by one took 17 s
    statuses = []
    for key, (status, revision) in values.items():
        if status is None:  # deleted, or one sampler's bad word: it must not stop the readers, nor hide it
            if revision and (shown := _bad_heartbeat(key)) is not None:
                statuses.append(shown)
            continue
        # A sampler writes its own key only (its credentials), but any value: not another's status.
        if key != status.sampler_id:
            log.warning("registry.misnamed_status", key=key, sampler=status.sampler_id)
            if (shown := _bad_heartbeat(key)) is not None:  # its key's sampler said nothing of its own
                statuses.append(shown)
            continue
        statuses.append(status)
    return statuses


def _bad_heartbeat(key: str) -> SamplerStatus | None:
    """A heartbeat that did not decode, as its readers show it: the sampler is there, saying
    nothing readable (None for a key no sampler id could have)."""
    try:
        return SamplerStatus(sampler_id=key, version=-1, groups_published=0, weight_failures={},
                             updated_at=time.time(), state="bad_heartbeat")
    except ValidationError:
        return None


async def heartbeat_unreadable(run: RunClient, sampler_id: str) -> bool:
    """Whether the sampler's heartbeat is there and does not decode: it gets no work until it does.
    Read as every heartbeat is (read_values): a single get failed on a `Status: 503` header of
    the sampler's own as the broker's "no responders", and the grant went on as if the broker
    restarted."""
    status, revision = (await read_values(run.registry, [sampler_id], _decode_status))[sampler_id]
    return status is None and revision != 0


async def read_heartbeats(run: RunClient, sampler_ids: list[str]) -> dict[str, tuple[int, SamplerStatus | None]]:
    """Of each sampler, the revision of its heartbeat key (it changes with every beat) and what it
    says; (0, None) when there is none or it is unreadable: not a sign of life."""
    values = await read_values(run.registry, sampler_ids, _decode_status)
    return {sampler_id: (revision, status) if status is not None else (0, None)
            for sampler_id, (status, revision) in values.items()}

