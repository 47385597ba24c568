"""Reading what the run keeps on the broker, once or followed: a KV key's value (read_value),
many keys' in a request (read_values), each new value of a state key (watch_forever), the
newest message of a last-value subject (LatestValue). Followers poll with direct gets rather
than make consumers: samplers may make none (streams/secure.py), and a restarted broker or
relay leaves nothing to rebuild. A value that does not decode is said, counted (BAD_VALUES) and
taken for absent, never fatal."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Awaitable, Callable, Generic, TypeVar

import structlog
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from echo.wire.codec import ProtocolError, decode
from streams.client import BROKER_ERRORS, RunClient, cancel_until_done, direct_get_batch

log = structlog.get_logger()

M = TypeVar("M")

POLL_S = 0.1  # how often a follower reads the newest value of what it follows
# How often one reads what changes rarely and no one waits on for a second (an operator's
# quarantine, the scheduler's choice): each reading is a request to the hub, per follower, and
# every POLL_S they were most of an idle trainer's requests and a thousand samplers' (2026-12-07).
RARELY_S = 1.0
BAD_VALUES: Counter[str] = Counter()  # values this process found malformed in the run's state, by key


def bad_value(key: str, reason: str) -> None:
    """A value that does not decode: said and counted, never fatal. Whoever reaches the broker
    may have written it (a JetStream answer reflected into a key, a sampler's own key): a
    reader takes it for absent and goes on."""
    BAD_VALUES[key] += 1
    log.warning("kv.bad_value", key=key, reason=reason[:200], seen=BAD_VALUES[key])


async def read_value(kv: KeyValue, key: str, decode_value: Callable[[bytes], M]) -> tuple[M | None, int]:
    """The key's value, decoded, and its revision: (None, 0) when there is none; (None, its
    revision) when it does not decode (bad_value)."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:  # KeyDeletedError too
        return None, 0
    try:
        return decode_value(entry.value or b""), entry.revision
    except ValueError as e:  # ProtocolError, a JSON or number that does not parse
        bad_value(key, str(e))
        return None, entry.revision


# Keys read_values asks for in one request: the server takes up to 1,024 subjects (ADR-31).
KEYS_A_REQUEST = 1024


async def read_values(kv: KeyValue, keys: list[str],
                      decode_value: Callable[[bytes], M]) -> dict[str, tuple[M | None, int]]:
    """read_value of each of `keys`, in one direct get of their last messages a KEYS_A_REQUEST
    (nats-server 2.11+, whose per-key TTLs the registry needs anyway). A request a key, the 256
    holders' heartbeats read every 5 s were most of the trainer's broker requests at 1,000
    samplers (2026-12-07), and the status snapshot's 1,000 took seconds."""
    values: dict[str, tuple[M | None, int]] = dict.fromkeys(keys, (None, 0))
    for first in range(0, len(keys), KEYS_A_REQUEST):
        subjects = [kv._pre + key for key in keys[first : first + KEYS_A_REQUEST]]
        for msg in await direct_get_batch(kv._js, kv._stream, {"multi_last": subjects}, kv._js._timeout):
            key, revision = msg.headers["Nats-Subject"].removeprefix(kv._pre), int(msg.headers["Nats-Sequence"])
            if key not in values:  # not asked for: the server answers the subjects named alone
                continue
            try:
                values[key] = decode_value(msg.data), revision
            except ValueError as e:  # as read_value
                bad_value(key, str(e))
                values[key] = None, revision
    return values


async def newest_after(js: JetStreamContext, stream: str, subject: str, after: int) -> RawStreamMsg | None:
    """The newest message of `subject` where it is later than stream sequence `after`, else None.
    Every subject followed keeps one message (a last-value stream, a KV bucket of history 1), so
    the first after `after` is the newest. Where nothing changed, the answer is a status line, not
    the value again: a thousand samplers reading the schedule (its lists name every sampler) ten
    times a second each moved the square of the fleet in bytes a second through the hub."""
    try:
        return await js.get_msg(stream, seq=after + 1, subject=subject, next=True, direct=True)
    except NotFoundError:
        return None


async def poll_newest(read: Callable[[int], Awaitable[tuple[int, bytes] | None]],
                      on_new: Callable[[int, bytes], Awaitable[None]], what: str, every_s: float = POLL_S) -> None:
    """Forever, every `every_s`: `read(after)` the newest (revision or stream sequence, value) of
    what is followed, if later than `after` (None: none newer) and hand it to `on_new`. No
    consumer: samplers may make none (streams/secure.py). A broker restarting is said once and
    waited out."""
    seen, failing = 0, False
    while True:
        try:
            newest = await read(seen)
            failing = False
        except BROKER_ERRORS as e:
            if not failing:
                log.warning("follow.read_failed", what=what, reason=repr(e))
            failing, newest = True, None
        if newest is not None and newest[0] > seen:
            seen = newest[0]
            await on_new(*newest)
        await asyncio.sleep(every_s)


async def watch_forever(run: RunClient, key: str, on_value: Callable[[bytes], None], every_s: float = POLL_S) -> None:
    """Call `on_value` with each new value of the state bucket's `key` (the current one first),
    forever (poll_newest, every `every_s`). A value `on_value` refuses (ProtocolError) is said, counted and
    skipped: the next good one counts."""
    async def read(after: int) -> tuple[int, bytes] | None:
        kv = run.state
        msg = await newest_after(kv._js, kv._stream, kv._pre + key, after)
        if msg is None or (msg.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):  # none newer, or deleted
            return None
        return msg.seq, msg.data or b""

    async def take(_: int, value: bytes) -> None:
        try:
            on_value(value)
        except ValueError as e:
            bad_value(key, str(e))

    await poll_newest(read, take, key, every_s)


class LatestValue(Generic[M]):
    """Follows one subject of the last-value control stream and holds its newest message.

    It reads the subject's newest message by direct get every POLL_S (newest_after): a late joiner reads the
    current value at once, a restarted broker or relay costs no consumer to rebuild, and it needs
    no consumer at all (samplers may make none, streams/secure.py)."""

    def __init__(
        self, js: JetStreamContext, stream: str, subject: str, cls: type[M], on_error: Callable[[ProtocolError], None]
    ):
        self.js, self.stream, self.subject, self.cls, self.on_error = js, stream, subject, cls, on_error
        self.value: M | None = None
        self.seq = 0  # stream sequence of `value`: orders messages of any kind
        self._changed = asyncio.Condition()
        self.task: asyncio.Task | None = None

    async def start(self) -> "LatestValue[M]":
        self.task = asyncio.create_task(poll_newest(self._read, self._take, self.subject))
        return self

    async def _read(self, after: int) -> tuple[int, bytes] | None:
        # The stream is named: a relay's mirror has no subjects to look it up by.
        msg = await newest_after(self.js, self.stream, self.subject, after)
        return None if msg is None else (msg.seq, msg.data or b"")

    async def _take(self, seq: int, data: bytes) -> None:
        try:
            value = decode(self.cls, data)
        except ProtocolError as e:
            self.on_error(e)
            return
        async with self._changed:
            self.value, self.seq = value, seq
            self._changed.notify_all()

    async def wait_newer(self, seq: int) -> tuple[int, M]:
        """Wait for a message later than stream sequence `seq`; return (its sequence, it)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.seq > seq)
            return self.seq, self.value

    async def stop(self) -> None:
        if self.task is not None:
            await cancel_until_done([self.task])
