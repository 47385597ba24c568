"""Rollouts on the wire: samplers publish groups on their own subject of the durable rollout
stream; the trainer reads each sampler's subject through a durable pull consumer of its own (a
reader) and acks each message explicitly."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Awaitable, Callable

import orjson
import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header
from nats.js.errors import APIError, NotFoundError

from echo.wire.codec import ProtocolError, RolloutLimits, encode_rollout, rollout_headers
from echo.wire.messages import RolloutGroup
from echo.wire.names import (
    BODY_PART_MAX,
    HDR_BODY_PARTS,
    HDR_BODY_SHA256,
    HDR_BODY_SIZE,
    HDR_MSG_ID,
    MAX_BODY_PARTS,
    ROLLOUT_MESSAGE_MAX,
    TRAINER_CONSUMER,
    RunNames,
    subject_sampler,
)
from streams.client import BROKER_ERRORS, RunClient, retry_forever, write_timeout_s

log = structlog.get_logger()

PUBLISH_RETRY_MAX_S = 10.0
HEADER_ROOM = 4096  # of a message's largest size, left for its headers
CONSUMER_PAGE = 256  # consumers in one CONSUMER.LIST answer
# The watch's consumer lives on one server: lost with it (a rolling restart), it is made again
# after two heartbeats go missing, while no group is fetched.
WATCH_HEARTBEAT_S = 1.0
FETCH_RETRY_S = 1.0  # after a failed fetch: the broker is restarting or moving the consumer


async def publish_rollout(run: RunClient, group: RolloutGroup) -> None:
    """Publish until the stream has it: through a broker restart or a relay's cut uplink (no
    responders), a sampler keeps its group and tries again with backoff, never dies of it. A
    group larger than one rollout message goes in parts on the sampler's bodies subject first;
    its rollout message then names them (echo/wire/names.py, HDR_BODY_PARTS)."""
    data, headers = encode_rollout(group), rollout_headers(group)
    if len(data) > min(run.nc.max_payload, ROLLOUT_MESSAGE_MAX) - HEADER_ROOM:
        part_size = min(run.nc.max_payload, BODY_PART_MAX) - HEADER_ROOM
        subject, sequences = run.names.bodies_subject(group.sampler_id), []
        for index, start in enumerate(range(0, len(data), part_size)):
            sequences.append(await _publish_until_stored(run, subject, data[start : start + part_size],
                                                         {HDR_MSG_ID: _part_id(group.group_id, index)}))
        headers |= {HDR_BODY_PARTS: ",".join(map(str, sequences)), HDR_BODY_SIZE: str(len(data)),
                    HDR_BODY_SHA256: hashlib.sha256(data).hexdigest()}
        data = b""
    await _publish_until_stored(run, run.names.rollouts_subject(group.sampler_id), data, headers)


async def _publish_until_stored(run: RunClient, subject: str, data: bytes, headers: dict[str, str]) -> int:
    """The message's stream sequence. Nats-Msg-Id makes a retry safe: a publish can time out
    although it was stored (the retry's ack then names the stored message's sequence)."""
    ack = await retry_forever(f"publish {headers[HDR_MSG_ID]}",
                              lambda: run.js.publish(subject, data, headers=headers, timeout=write_timeout_s(len(data))),
                              first_delay_s=0.5, max_delay_s=PUBLISH_RETRY_MAX_S)
    return ack.seq


def _part_id(group_id: str, index: int) -> str:
    return f"{group_id}-{index}"


async def rollout_body(js: JetStreamContext, names: RunNames, msg, limits: RolloutLimits | None = None) -> bytes:
    """A rollout message's encoded group: its own data, or a large group's parts, read by their
    sequences from the bodies stream, each on the bodies subject of the sampler whose subject the
    message came on and named as that group's part, and checked against the size and digest the
    message names (ProtocolError "bad_body" when they are missing or do not add up). A size beyond
    the run's `limits` is refused before a part is read ("too_large")."""
    headers = msg.headers or {}
    if HDR_BODY_PARTS not in headers:
        return msg.data
    group_id = headers.get(HDR_MSG_ID, "")
    try:
        subject = names.bodies_subject(subject_sampler(msg.subject))
        sequences = [int(seq) for seq in headers[HDR_BODY_PARTS].split(",", MAX_BODY_PARTS)]
        size, digest = int(headers[HDR_BODY_SIZE]), headers[HDR_BODY_SHA256]
    except (KeyError, ValueError) as e:
        raise ProtocolError("bad_body", f"a body in parts named badly: {e}") from None
    if msg.data or len(sequences) > MAX_BODY_PARTS:  # before reading a part: a sender may claim billions
        raise ProtocolError("bad_body", f"{len(sequences)} parts (1 to {MAX_BODY_PARTS}), and no data of its own")
    if limits is not None:
        limits.check_size(size)
    parts = []
    for index, sequence in enumerate(sequences):
        part = await _body_part(js, names, sequence)
        if part is None or part.subject != subject or (part.headers or {}).get(HDR_MSG_ID) != _part_id(group_id, index):
            raise ProtocolError("bad_body", f"group {group_id}: its part {index} (sequence {sequence}) is missing "
                                            f"or not its sampler's")
        parts.append(part.data)
    data = b"".join(parts)
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise ProtocolError("bad_body", f"group {group_id}: its parts make {len(data)} bytes that do not match "
                                        f"the {size} bytes and digest its message names")
    return data


async def _body_part(js: JetStreamContext, names: RunNames, sequence: int):
    """The bodies stream's message at `sequence`, or None when it has none there (never stored,
    or gone past its sampler's quota)."""
    while True:
        try:
            return await js.get_msg(names.bodies_stream, sequence)
        except NotFoundError:
            return None
        except BROKER_ERRORS as e:  # a broker restarting: the part is still there
            log.warning("rollout.body_read_failed", sequence=sequence, reason=repr(e))
            await asyncio.sleep(0.5)


def reader_name(names: RunNames, subject: str) -> str:
    """The trainer's durable consumer on one sampler's rollout subject. A subject that names no
    valid sampler id (possible only without credentials) gets a consumer all the same, named by
    its digest, so every message on the stream has a reader and is accounted for."""
    try:
        if names.rollouts_subject(subject_sampler(subject)) == subject:
            return f"{TRAINER_CONSUMER}-{subject_sampler(subject)}"
    except ValueError:  # not a sampler id
        pass
    return f"{TRAINER_CONSUMER}~{hashlib.sha256(subject.encode()).hexdigest()[:24]}"


def is_reader(consumer_name: str) -> bool:
    return consumer_name.startswith((f"{TRAINER_CONSUMER}-", f"{TRAINER_CONSUMER}~"))


async def reader_subscription(run: RunClient, subject: str, ack_wait_s: float = 600.0):
    """The trainer's durable pull consumer on one sampler's subject: reading each sampler through
    its own, the trainer takes them in turn, and no sampler's backlog stands in front of another's
    (one consumer over every subject delivers in stream order). Messages are acked after the step
    that used (or dropped) them; unacked ones come back after ack_wait."""
    name = reader_name(run.names, subject)
    config = ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_ack_pending=-1,
        filter_subject=subject,
    )
    # Created, or brought to this config (a restarted trainer given another ack_wait_s):
    # pull_subscribe alone would bind to an existing consumer as it is.
    await run.js.add_consumer(run.names.rollouts_stream, config)
    return await run.js.pull_subscribe_bind(name, run.names.rollouts_stream)


async def reset_reader(run: RunClient, name: str) -> None:
    """Offer again at once every message a reader has not had acked (nats-server 2.14's consumer
    reset, to its ack floor): deliveries lost with a dropped connection, or made to a trainer
    that died, would otherwise come back only after ack_wait."""
    await _jetstream_api(run, f"CONSUMER.RESET.{run.names.rollouts_stream}.{name}", b"{}")


async def _jetstream_api(run: RunClient, call: str, body: bytes = b"") -> dict:
    """A JetStream API request made by hand (an API nats-py lacks, or an answer read for a few
    fields): its answer as a dict, or the server's refusal raised as nats-py's APIError."""
    answer = orjson.loads((await run.nc.request(f"{run.js._prefix}.{call}", body, timeout=run.js._timeout)).data)
    if "error" in answer:
        raise APIError.from_error(answer["error"])
    return answer


async def rollout_subjects(run: RunClient) -> tuple[int, list[str]]:
    """The rollouts stream's last sequence and the subjects it holds messages on, read at one
    instant (the trainer's own call: samplers may not ask for stream INFO)."""
    info = await run.js.stream_info(run.names.rollouts_stream, subjects_filter=run.names.all_rollouts)
    return info.state.last_seq, list(info.state.subjects or {})


async def last_rollout_seq(run: RunClient) -> int:
    """The rollouts stream's last sequence (its INFO without the subjects listing)."""
    return (await run.js.stream_info(run.names.rollouts_stream)).state.last_seq


@dataclass(frozen=True)
class ReaderState:
    """What the trainer reads of a reader's (a sampler subject's durable consumer's) state."""

    name: str
    num_pending: int  # stored, not yet delivered
    num_ack_pending: int  # delivered, not yet acked
    ack_floor_seq: int  # every message of its subject up to this stream sequence is acked


async def readers(run: RunClient) -> list[ReaderState]:
    """Every reader's state, in one request per 256 (the server's page), parsed for these fields
    alone: nats-py's ConsumerInfo of each of 1,000 samplers' readers, every pull round, took a
    third of the trainer's CPU at 1,000 samplers (py-spy on bench/load.py, 2026-12-06)."""
    found: list[ReaderState] = []
    while True:
        answer = await _jetstream_api(run, f"CONSUMER.LIST.{run.names.rollouts_stream}",
                                      orjson.dumps({"offset": len(found)}) if found else b"")
        page = answer.get("consumers") or []
        found += [ReaderState(c["name"], c.get("num_pending", 0), c.get("num_ack_pending", 0),
                              (c.get("ack_floor") or {}).get("stream_seq", 0)) for c in page]
        if len(page) < CONSUMER_PAGE:
            return [state for state in found if is_reader(state.name)]


async def watch_rollouts(run: RunClient, start_seq: int, on_arrival: Callable[[Msg], Awaitable[None]]):
    """Each rollout message from `start_seq` on, headers only and in stream order, handed to
    `on_arrival`: which samplers have published, for a few hundred bytes a message where listing
    the readers costs hundreds a sampler. An ordered consumer: nats-py starts it again past the
    last message seen after a gap or two missed heartbeats (WATCH_HEARTBEAT_S)."""
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
    return await run.js.subscribe(run.names.all_rollouts, stream=run.names.rollouts_stream, cb=on_arrival,
                                  config=config, ordered_consumer=True, headers_only=True,
                                  idle_heartbeat=WATCH_HEARTBEAT_S)


def late_rollouts(subscription) -> int | None:
    """The messages a reader's subscription queued for a fetch that gave up waiting (None: none
    queued, its answer not come yet). The status that ends such a pull request (its expiry, 408)
    is queued with them and is not counted: taken for a message, it had the next round fetch
    from an empty reader, wait out its expiry and leave another such status behind, round after
    round."""
    if not subscription.pending_msgs:
        return None
    # nats-py tells only how many are queued, not what: its queue is read in place, not taken from.
    return sum(not (msg.headers or {}).get(Header.STATUS) for msg in subscription._sub._pending_queue._queue)


async def fetch_rollouts(subscription, batch: int, timeout: float) -> list:
    """Up to `batch` messages, or [] when none arrived within `timeout`."""
    try:
        return await subscription.fetch(batch, timeout=timeout)
    except (NatsTimeout, asyncio.TimeoutError):
        return []
    except BROKER_ERRORS as e:  # a broker restarting, a cluster moving the consumer's leader
        log.warning("rollouts.fetch_failed", reason=repr(e))
        await asyncio.sleep(min(timeout, FETCH_RETRY_S))
        return []



async def account_storage(run: RunClient) -> dict[str, int | None]:
    """What the run's account keeps on the broker's disk (on an open broker: every run's), and its
    limit (`secure init --run-storage-gb`; None: no limit)."""
    info = await run.js.account_info()
    return {"bytes": info.storage, "limit": info.limits.max_storage if info.limits.max_storage >= 0 else None}


async def rollouts_backlog(run: RunClient) -> dict[str, int] | None:
    """The rollout stream's messages and bytes, and its readers' pending (not yet delivered) and
    unacked messages; None before the trainer has created the stream."""
    try:
        info = await run.js.stream_info(run.names.rollouts_stream)
        consumers = await readers(run)
    except NotFoundError:
        return None
    return {"messages": info.state.messages, "bytes": info.state.bytes,
            "pending": sum(c.num_pending for c in consumers), "unacked": sum(c.num_ack_pending for c in consumers)}
