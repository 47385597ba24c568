"""The run's registry of samplers: each sampler's heartbeat (SamplerStatus) is one key of the
run's state bucket, rewritten every few seconds with a per-key TTL, so anyone (the trainer, the
scheduler, an operator) can see who runs what, how fast and at what cost, and a dead sampler's
entry expires by itself."""

from __future__ import annotations

import structlog
from nats.js.errors import KeyNotFoundError

from echo.protocol import (LEARNER_KEY, SAMPLER_STATUS_PREFIX, LearnerStatus, ProtocolError, SamplerStatus, decode,
                           encode)
from streams.client import Run, put_expiring

log = structlog.get_logger()


async def put_status(run: Run, status: SamplerStatus) -> None:
    await put_expiring(run.state, SAMPLER_STATUS_PREFIX + status.sampler_id, encode(status), status.ttl_s)


async def put_learner(run: Run, status: LearnerStatus) -> None:
    await run.state.put(LEARNER_KEY, encode(status))


async def read_learner(run: Run) -> LearnerStatus | None:
    try:
        return decode(LearnerStatus, (await run.state.get(LEARNER_KEY)).value)
    except KeyNotFoundError:  # no step taken yet
        return None


async def weights_relay(run: Run, hub_domain: str) -> str:
    """The JetStream domain of the relay this client reads weights from; "" on the hub itself."""
    domain = (await run.local_js.account_info()).domain or ""
    return "" if domain == hub_domain else domain


async def read_statuses(run: Run) -> list[SamplerStatus]:
    # The bucket's stream lists its subjects exactly. nats-py's `keys()` watches the bucket
    # instead and can stop before the first key arrives (its end marker races the delivery).
    prefix = f"$KV.{run.names.state_bucket}."
    info = await run.js.stream_info(f"KV_{run.names.state_bucket}", subjects_filter=prefix + SAMPLER_STATUS_PREFIX + ">")
    statuses = []
    for subject in sorted(info.state.subjects or {}):
        key = subject.removeprefix(prefix)
        try:
            status = decode(SamplerStatus, (await run.state.get(key)).value)
        except KeyNotFoundError:  # deleted
            continue
        except ProtocolError as e:  # one sampler's word: its bad heartbeat must not stop the readers
            log.warning("registry.bad_status", key=key, reason=str(e))
            continue
        # A sampler writes its own key only (its credentials), but any value: not another's status.
        if key != SAMPLER_STATUS_PREFIX + status.sampler_id:
            log.warning("registry.misnamed_status", key=key, sampler=status.sampler_id)
            continue
        statuses.append(status)
    return statuses


async def read_heartbeat(run: Run, sampler_id: str) -> tuple[int, SamplerStatus | None]:
    """The revision of the sampler's heartbeat key (0: none yet; it changes with every beat) and
    what it says (None: none yet, or unreadable)."""
    try:
        entry = await run.state.get(SAMPLER_STATUS_PREFIX + sampler_id)
    except KeyNotFoundError:
        return 0, None
    try:
        return entry.revision, decode(SamplerStatus, entry.value)
    except ProtocolError:
        return entry.revision, None
