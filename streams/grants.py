"""Work grants on the wire: a sampler asks the trainer for groups to generate (request/reply
on its own grants subject) and the trainer alone decides, so no sampler can take work meant
for the others. Used by both modes: async mode's grant budget and sequential mode's pull
requests. Async mode's GrantBudget and the count of slots granted so far live in the run's
state bucket, written by the trainer only."""

from __future__ import annotations

import re
from typing import Awaitable, Callable

import structlog

from echo.wire.codec import ProtocolError, decode, encode
from echo.wire.messages import Grant, GrantBudget, GrantRequest
from echo.wire.names import BUDGET_KEY, GRANT_TIMEOUT_S, SLOTS_KEY, SLOTS_KEY_BEFORE_14, subject_sampler
from streams.client import BROKER_ERRORS, RunClient
from streams.watch import read_value, watch_forever

log = structlog.get_logger()

Decide = Callable[[str, GrantRequest], Awaitable[Grant]]  # (sampler id, request) -> the answer

# nats-py's `_INBOX.`, a secured client's `_INBOX_<key>.`; `_R_.`: the server's name for a request
# that came through an account import, whose answer it routes back into the requester's account.
INBOX = re.compile(r"^(_INBOX[._]|_R_\.)[A-Za-z0-9_.-]+$")


def is_inbox(reply: str) -> bool:
    """Whether an answer may go to `reply`: a client's inbox, which no stream of a run captures
    (they capture echo.<run>.>, $KV.<bucket>.> and $O.<bucket>.>) and only its owner reads."""
    return bool(INBOX.match(reply or ""))


async def serve_grants(run: RunClient, decide: Decide):
    """Answer every sampler's grant requests with `decide`; returns the subscription. The
    sampler id comes from the subject, which a secured sampler cannot choose."""

    async def on_request(msg) -> None:
        sampler_id = subject_sampler(msg.subject)
        if not is_inbox(msg.reply):  # a reply subject is not permission-checked: it could name a stream's
            log.warning("grant.reply_refused", sampler=sampler_id, reply=msg.reply[:200])
            return
        try:
            grant = await decide(sampler_id, decode(GrantRequest, msg.data))
        except ProtocolError as e:
            log.warning("grant.bad_request", sampler=sampler_id, reason=str(e))
            grant = Grant()
        except Exception:  # a defect of ours: said with its traceback, and the sampler still answered
            log.exception("grant.failed", sampler=sampler_id)
            grant = Grant()
        # Not msg.respond: nats-py copies the request's headers onto the answer (Nats-Rollup among them).
        await run.nc.publish(msg.reply, encode(grant))

    return await run.nc.subscribe(run.names.all_grants, cb=on_request)


async def request_grant(run: RunClient, sampler_id: str, request: GrantRequest,
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


async def publish_budget(run: RunClient, budget: GrantBudget) -> None:
    await run.state.put(BUDGET_KEY, encode(budget))


async def watch_budget(run: RunClient, on_budget: Callable[[GrantBudget], None]) -> None:
    """Call `on_budget` with each budget the trainer publishes, so idle samplers ask for work
    again at once instead of polling the trainer. One that does not decode is said and skipped."""
    await watch_forever(run, BUDGET_KEY, lambda value: on_budget(decode(GrantBudget, value)))


async def slots_granted(run: RunClient) -> int:
    """Slots granted so far: a restarted trainer numbers its grants on from there."""
    for key in (SLOTS_KEY, SLOTS_KEY_BEFORE_14):
        granted = (await read_value(run.state, key, int))[0]
        if granted is not None:
            return granted
    return 0


async def record_slots_granted(run: RunClient, granted: int) -> None:
    await run.state.put(SLOTS_KEY, str(granted).encode())
