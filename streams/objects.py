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
import contextlib
import hashlib
import json
from collections import deque
from datetime import datetime, timezone

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMetaOptions
from nats.js.errors import NotFoundError
from nats.nuid import NUID

from streams.client import BROKER_ERRORS, bind_object_store

CHUNK_SIZE = 1 << 20  # publish throughput peaks at 1 MiB chunks on loopback
WINDOW = 16  # chunk publishes awaiting their ack
BATCH_BYTES = 8 << 20  # per batched get: well under the server's 64 MiB max_pending for one client
ACK_TIMEOUT_S = 30.0


class TransferError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def sha256_hex(info: ObjectInfo) -> str:
    """The object's SHA-256 as hex, from its info (which stores it as SHA-256=<base64url>)."""
    return base64.urlsafe_b64decode(info.digest.removeprefix("SHA-256=")).hex()


async def put_object(
    js: JetStreamContext, bucket: str, name: str, data: bytes, headers: dict[str, list[str]] | None = None
) -> ObjectInfo:
    chunk_size = min(CHUNK_SIZE, js._nc.max_payload - 1024)  # room for the protocol line
    store = f"OBJ_{bucket}"
    try:
        previous = await bind_object_store(js, bucket).get_info(name)
    except NotFoundError:
        previous = None
    nuid = NUID().next().decode()
    chunks_subject = f"$O.{bucket}.C.{nuid}"
    digest, in_flight, view = hashlib.sha256(), deque(), memoryview(data)
    try:
        for start in range(0, len(view), chunk_size):
            chunk = view[start : start + chunk_size]
            digest.update(chunk)
            in_flight.append(await js.publish_async(chunks_subject, bytes(chunk)))
            if len(in_flight) >= WINDOW:
                await asyncio.wait_for(in_flight.popleft(), ACK_TIMEOUT_S)
        for ack in in_flight:  # publish_async futures have no timeout of their own
            await asyncio.wait_for(ack, ACK_TIMEOUT_S)
    except BaseException:
        for ack in in_flight:  # acks that may never come: no publish slot held for them
            ack.cancel()
        with contextlib.suppress(*BROKER_ERRORS):  # the reason is the error above, not this clean-up's
            await js.purge_stream(store, subject=chunks_subject)
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
    meta_subject = f"$O.{bucket}.M.{_b64(name.encode())}"
    await js.publish(meta_subject, json.dumps(info.as_dict()).encode(), headers={"Nats-Rollup": "sub"})
    if previous is not None and not previous.deleted:  # the name now points at the new chunks
        await js.purge_stream(store, subject=f"$O.{bucket}.C.{previous.nuid}")
    return info


async def get_object(
    js: JetStreamContext, bucket: str, name: str, expected_sha256: str | None = None,
    expected_size: int | None = None, timeout: float = 10.0,
) -> bytearray:
    """The object's bytes, checked against its info's size and SHA-256 (and `expected_sha256`,
    hex, and `expected_size` when given: the object must be the one its announcer meant), or
    TransferError. The size is checked before the buffer is allocated: a forged info cannot
    make a reader allocate more than it was told to expect."""
    try:
        info = await bind_object_store(js, bucket).get_info(name)
    except NotFoundError:
        raise TransferError("not_found", f"{bucket}/{name}") from None
    if expected_size is not None and info.size != expected_size:
        raise TransferError("size_mismatch", f"{bucket}/{name} holds {info.size} bytes, expected {expected_size}")
    data = bytearray(info.size)
    digest, offset, received = hashlib.sha256(), 0, 0
    if info.chunks:
        chunk_size = (info.options.max_chunk_size if info.options else None) or 128 * 1024
        subject, after = f"$O.{bucket}.C.{info.nuid}", 0
        while received < info.chunks:
            batch = min(max(1, BATCH_BYTES // chunk_size), info.chunks - received)
            msgs = await direct_get_batch(js, f"OBJ_{bucket}", subject, after + 1, batch, timeout)
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


async def direct_get_batch(js: JetStreamContext, stream: str, subject: str, start: int, batch: int,
                           timeout: float) -> list:
    """Up to `batch` messages of `subject` from stream sequence `start` on, in one direct get
    (nats-server 2.11's batched form: the messages, then an end-of-batch status); [] when there
    are none. Each carries Nats-Sequence and Nats-Num-Pending (those of the subject after it)."""
    nc = js._nc
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox, max_msgs=batch + 1)
    try:
        request = json.dumps({"next_by_subj": subject, "seq": start, "batch": batch}).encode()
        await nc.publish(f"{js._prefix}.DIRECT.GET.{stream}", request, reply=inbox)
        msgs = []
        while True:
            try:
                msg = await subscription.next_msg(timeout=timeout)
            except TimeoutError:  # nats-py's subclasses it
                raise TransferError("timeout", f"{len(msgs)} of a batch of {batch} arrived") from None
            status = (msg.headers or {}).get("Status")
            if status in ("204", "404"):  # the end of the batch; nothing there
                return msgs
            if status is not None:
                raise TransferError("refused", f"direct get of {stream}: {status} {msg.headers.get('Description', '')}")
            msgs.append(msg)
    finally:
        await subscription.unsubscribe()
