"""Work grants on the wire: a sampler asks the trainer for groups to generate (request/reply
on its own grants subject) and the trainer alone decides, so no sampler can take work meant
for the others. Used by both modes: async leases and sequential mode's pull requests."""

from __future__ import annotations

from typing import Awaitable, Callable

import structlog

from echo.protocol import GRANT_TIMEOUT_S, Grant, GrantRequest, ProtocolError, decode, encode, subject_sampler
from streams.client import BROKER_ERRORS, Run

log = structlog.get_logger()

Decide = Callable[[str, GrantRequest], Awaitable[Grant]]  # (sampler id, request) -> the answer


async def serve_grants(run: Run, decide: Decide):
    """Answer every sampler's grant requests with `decide`; returns the subscription. The
    sampler id comes from the subject, which a secured sampler cannot choose."""

    async def on_request(msg) -> None:
        sampler_id = subject_sampler(msg.subject)
        try:
            grant = await decide(sampler_id, decode(GrantRequest, msg.data))
        except ProtocolError as e:
            log.warning("grant.bad_request", sampler=sampler_id, reason=str(e))
            grant = Grant()
        except Exception:  # a defect of ours: said with its traceback, and the sampler still answered
            log.exception("grant.failed", sampler=sampler_id)
            grant = Grant()
        await msg.respond(encode(grant))

    return await run.nc.subscribe(run.names.all_grants, cb=on_request)


async def request_grant(run: Run, sampler_id: str, request: GrantRequest,
                        timeout: float = GRANT_TIMEOUT_S) -> Grant | None:
    """The trainer's answer, or None when none came (no trainer yet, a busy one, a broker
    restarting): not "nothing left", which only the trainer can say."""
    try:
        reply = await run.nc.request(run.names.grants_subject(sampler_id), encode(request), timeout=timeout)
    except BROKER_ERRORS:
        return None
    try:
        return decode(Grant, reply.data)
    except ProtocolError as e:  # a status-only reply while the broker restarts, or an old trainer
        log.warning("grant.bad_reply", reason=str(e))
        return None
