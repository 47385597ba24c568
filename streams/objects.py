"""Our own object-store transfer. It writes and reads the JetStream object store's wire format
(chunks on `$O.<bucket>.C.<nuid>`, a rolled-up info message on `$O.<bucket>.M.<name>`), so any
client reads what we write, but it moves the bytes faster than nats-py's ObjectStore:

- put publishes chunks with a window of acks in flight instead of waiting for each one;
- get reads the chunk subject with batched direct gets (no consumer: a reader that may make
  consumers can make thousands, streams/secure.py) of bounded size into one preallocated buffer
  (nats-py's get() into bytes is quadratic), and checks size and SHA-256.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections import deque
from datetime import datetime, timezone

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMetaOptions
from nats.js.errors import APIError, NotFoundError
from nats.nuid import NUID

from streams.client import BROKER_ERRORS, direct_get_batch

log = structlog.get_logger()

CHUNK_SIZE = 1 << 20  # publish throughput peaks at 1 MiB chunks on loopback
WINDOW = 16  # chunk publishes awaiting their ack
BATCH_BYTES = 8 << 20  # per batched get: well under the server's 64 MiB max_pending for one client
# How long a chunk's ack may take before the put is given up and tried again: it comes in
# milliseconds to a second (a window's bytes on a slow uplink); none in 5 s means the stream's
# leader is gone with it (a cluster node killed: a new leader is elected meanwhile). Was 30 s: a
# publish caught by a leader's death took 34 s where 3 was the norm.
ACK_TIMEOUT_S = 5.0
PURGE_TIMEOUT_S = 1.0  # for a failed put's chunks: its retry waits for this clean-up
ACK_POLL_S = 0.1  # how often a wait for an ack looks whether the connection it was sent on dropped
# A replica's lag behind another (milliseconds; seconds just after a failover), and how often a
# read that found chunks missing looks again within it.
REPLICA_LAG_S, REREAD_S = 3.0, 0.1


class AckLost(nats.errors.Error):
    """A chunk's ack that will not come: a broker error (BROKER_ERRORS), so the put is tried again."""


class TransferError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def sha256_hex(info: ObjectInfo) -> str:
    """The object's SHA-256 as hex, from its info (which stores it as SHA-256=<base64url>)."""
    return base64.urlsafe_b64decode(info.digest.removeprefix("SHA-256=")).hex()


def _refusals_reach_their_acks(js: JetStreamContext) -> None:
    """nats-py 2.16 leaves a publish_async future pending when the server refuses the message
    (its APIError.from_error raises where the ack handler expects a return: nats-io/nats.py#985,
    fix pending in #994): the refusal reached only the error callback, and a put refused for room
    waited out ACK_TIMEOUT_S and was tried again, for ever. The handler is wrapped, before the
    context's first publish_async subscribes it, to hand the refusal to its future."""
    if js._async_reply_prefix:  # subscribed already: wrapped then, by the first put
        return
    handle = js._handle_async_reply

    async def refusal_to_future(msg) -> None:
        try:
            await handle(msg)
        except APIError as e:
            future = js._publish_async_futures.get(msg.subject[len(js._nc._inbox_prefix) + 22 + 2 :])
            if future is not None and not future.done():
                future.set_exception(e)

    js._handle_async_reply = refusal_to_future


async def put_object(
    js: JetStreamContext, bucket: str, name: str, data: bytes, headers: dict[str, list[str]] | None = None
) -> ObjectInfo:
    chunk_size = min(CHUNK_SIZE, js._nc.max_payload - 1024)  # room for the protocol line
    store = f"OBJ_{bucket}"
    nuid = NUID().next().decode()
    chunks_subject = f"$O.{bucket}.C.{nuid}"
    digest, in_flight, view = hashlib.sha256(), deque(), memoryview(data)
    connection = js._nc.stats["reconnects"]
    _refusals_reach_their_acks(js)
    try:
        for start in range(0, len(view), chunk_size):
            chunk = view[start : start + chunk_size]
            digest.update(chunk)
            in_flight.append(await js.publish_async(chunks_subject, bytes(chunk)))
            if len(in_flight) >= WINDOW:
                await _acked(js, in_flight.popleft(), connection)
        for ack in in_flight:
            await _acked(js, ack, connection)
    except BaseException:
        for ack in in_flight:  # acks that may never come: no publish slot held for them
            ack.cancel()
        try:  # briefly: a stream whose leader is gone answers no purge until it has a new one
            await asyncio.wait_for(js.purge_stream(store, subject=chunks_subject), PURGE_TIMEOUT_S)
        except BROKER_ERRORS as e:  # the reason is the error above, not this clean-up's
            log.warning("objects.chunks_left", subject=chunks_subject, reason=repr(e))
        raise
    info = ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=len(view),
        chunks=-(-len(view) // chunk_size),
        mtime=datetime.now(timezone.utc).isoformat(),
        digest=f"SHA-256={_b64(digest.digest())}",
        headers=headers,
        options=ObjectMetaOptions(max_chunk_size=chunk_size),
    )
    previous = await object_info(js, bucket, name)
    meta_subject = f"$O.{bucket}.M.{_b64(name.encode())}"
    await js.publish(meta_subject, json.dumps(info.as_dict()).encode(), headers={"Nats-Rollup": "sub"})
    if previous is not None:  # the name now points at the new chunks
        await js.purge_stream(store, subject=f"$O.{bucket}.C.{previous.nuid}")
    return info


async def object_info(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    """The object's info (None: absent or deleted), by a direct get of its meta message: any
    replica or mirror answers one, so it needs no stream leader (a cluster elects a new one 4-9 s
    after a node's death, and a leader's get waits that out, then its timeout)."""
    try:
        msg = await js.get_last_msg(f"OBJ_{bucket}", f"$O.{bucket}.M.{_b64(name.encode())}", direct=True)
    except NotFoundError:
        return None
    info = ObjectInfo.from_response(json.loads(msg.data))
    return None if info.deleted else info


async def _acked(js: JetStreamContext, ack: asyncio.Future, connection: int) -> None:
    """Wait for a chunk's ack (publish_async futures have no timeout of their own); AckLost
    when none came within ACK_TIMEOUT_S, or at once when the connection it was sent on dropped
    (the server that would have answered is gone: nats-py never resolves it)."""
    deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
    while not ack.done():
        await asyncio.wait([ack], timeout=ACK_POLL_S)
        if not ack.done() and js._nc.stats["reconnects"] != connection:
            raise AckLost("the connection a chunk was sent on dropped before its ack")
        if not ack.done() and asyncio.get_running_loop().time() > deadline:
            raise AckLost(f"no ack for a chunk within {ACK_TIMEOUT_S:.0f} s")
    ack.result()


async def get_object(
    js: JetStreamContext, bucket: str, name: str, expected_sha256: str | None = None,
    expected_size: int | None = None, timeout: float = 10.0, max_size: int | None = None,
) -> bytearray:
    """The object's bytes, checked against its info's size and SHA-256 (and `expected_sha256`,
    hex, and `expected_size` when given: the object must be the one its announcer meant), or
    TransferError. The size is checked before the buffer is allocated (against `expected_size`,
    or at most `max_size`): a forged info cannot make a reader allocate more than it was told
    to expect.

    Direct gets are answered by any replica, and one may be behind another: the info read from
    one and the chunks from one that lacks them yet (or an older info whose chunks the newer
    put purged) look truncated for a moment, and an object just put is not found on one that
    has not applied its info yet. A truncated read, or the absence of an object the caller was
    told of (`expected_sha256`), is read again, whole, for up to REPLICA_LAG_S before it is
    believed (the CI's 3-node cluster failed both ways right after a failover)."""
    began, said = asyncio.get_running_loop().time(), False
    lag = {"truncated", "not_found"} if expected_sha256 is not None else {"truncated"}
    while True:
        try:
            return await _read_object(js, bucket, name, expected_sha256, expected_size, timeout, max_size)
        except TransferError as e:
            waited_s = asyncio.get_running_loop().time() - began
            if e.reason not in lag or waited_s > REPLICA_LAG_S:
                raise
            if not said:
                log.info("objects.read_again", bucket=bucket, name=name, reason=str(e), within_s=REPLICA_LAG_S)
                said = True
        await asyncio.sleep(REREAD_S)


async def _read_object(
    js: JetStreamContext, bucket: str, name: str, expected_sha256: str | None,
    expected_size: int | None, timeout: float, max_size: int | None,
) -> bytearray:
    info = await object_info(js, bucket, name)
    if info is None:
        raise TransferError("not_found", f"{bucket}/{name}")
    if expected_size is not None and info.size != expected_size:
        raise TransferError("size_mismatch", f"{bucket}/{name} holds {info.size} bytes, expected {expected_size}")
    if max_size is not None and info.size > max_size:
        raise TransferError("too_large", f"{bucket}/{name} holds {info.size} bytes, at most {max_size} expected")
    data = bytearray(info.size)
    digest, offset, received = hashlib.sha256(), 0, 0
    if info.chunks:
        chunk_size = (info.options.max_chunk_size if info.options else None) or 128 * 1024
        subject, after = f"$O.{bucket}.C.{info.nuid}", 0
        while received < info.chunks:
            batch = min(max(1, BATCH_BYTES // chunk_size), info.chunks - received)
            try:
                msgs = await direct_get_batch(js, f"OBJ_{bucket}", {"next_by_subj": subject, "seq": after + 1,
                                                                    "batch": batch}, timeout)
            except TimeoutError as e:
                raise TransferError("timeout", str(e)) from None
            except nats.errors.Error as e:
                raise TransferError("refused", str(e)) from None
            if not msgs or (received == 0 and int(msgs[0].headers["Nats-Num-Pending"]) + 1 != info.chunks):
                # Known before the bytes move: a missing chunk never comes.
                stored = int(msgs[0].headers["Nats-Num-Pending"]) + 1 if msgs else received
                raise TransferError("truncated", f"{stored} of {info.chunks} chunks stored")
            for msg in msgs:
                end = offset + len(msg.data)
                if end > info.size:
                    raise TransferError("size_mismatch", f"more than the {info.size} bytes announced")
                data[offset:end] = msg.data
                digest.update(msg.data)
                offset, received = end, received + 1
            after = int(msgs[-1].headers["Nats-Sequence"])
    if offset != info.size:
        raise TransferError("size_mismatch", f"got {offset} bytes, info says {info.size}")
    if f"SHA-256={_b64(digest.digest())}" != info.digest:
        raise TransferError("digest_mismatch", f"{bucket}/{name}")
    if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
        raise TransferError("digest_mismatch", f"{bucket}/{name} is not the object expected")
    return data
