"""The trainer's rollout inbox: every JetStream delivery mechanic of its durable pull consumer
on the rollouts stream. The trainer sees deliveries (a stream sequence, a subject, headers, an
encoded group) and says when its step is checkpointed; this module fetches, holds each message
unacked until then, keeps held messages alive through a long step, acks them with the broker's
confirmation, and reads the consumer's counts for the run's accounting."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg

from echo.protocol import RolloutLimits, subject_sampler
from streams.client import BROKER_ERRORS, Run
from streams.rollouts import fetch_rollouts, rollout_body, trainer_subscription

log = structlog.get_logger()

ACK_ATTEMPTS = 3  # a held message's ack is confirmed, or left for the broker to offer again
# What one fetch may have the server send: half its max_pending for one client (64 MB), so that
# a fetch of the largest messages never makes it close the trainer's connection (the batch lost
# with it came back only after ack_wait).
FETCH_BYTES = 32 << 20


@dataclass(frozen=True)
class Delivery:
    """One rollout message as the stream delivered it."""

    seq: int  # its stream sequence: the same message offered again has the same one
    subject: str
    headers: dict[str, str]
    msg: Msg = field(repr=False)
    arrived: float = 0.0  # when the broker stored it, on this process's monotonic clock

    @property
    def sender(self) -> str:
        """The sampler whose subject it came on (its credentials allow it no other)."""
        return subject_sampler(self.subject)


@dataclass(frozen=True)
class ConsumerCounts:
    """The consumer's counts at one instant."""

    ack_floor: int  # every stream sequence up to this one is acked
    published: int  # messages on the stream for this consumer: delivered and not yet delivered
    pending: int  # not yet delivered, or delivered and not acked


class RolloutInbox:
    def __init__(self, run: Run, subscription):
        self.run, self.subscription = run, subscription
        self.held: list[Delivery] = []  # fetched and not yet acked

    @classmethod
    async def open(cls, run: Run, ack_wait_s: float = 600.0) -> "RolloutInbox":
        return cls(run, await trainer_subscription(run, ack_wait_s))

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to `batch` deliveries ([] when none came within `timeout`), each held until ack_held;
        no more at once than FETCH_BYTES of messages of the server's largest size."""
        batch = max(1, min(batch, FETCH_BYTES // self.run.nc.max_payload))
        msgs = await fetch_rollouts(self.subscription, batch, timeout)
        now, wall = time.monotonic(), time.time()
        deliveries = [Delivery(msg.metadata.sequence.stream, msg.subject, msg.headers or {}, msg,
                               arrived=now - max(0.0, wall - msg.metadata.timestamp.timestamp()))
                      for msg in msgs]
        self.held += deliveries  # acked after the checkpoint, used or not; they stay in the stream for replay
        return deliveries

    async def body(self, delivery: Delivery, limits: RolloutLimits | None = None) -> bytes:
        """Its encoded group: its own data, or a large group's parts (ProtocolError "bad_body";
        "too_large" before a part is read, for a size beyond `limits`)."""
        return await rollout_body(self.run.js, self.run.names, delivery.msg, limits)

    async def keep_alive(self, every: float) -> None:
        """Tell the server the held messages are still being worked on, so a long step does not
        get them redelivered, while a crashed trainer's are redelivered after one ack_wait."""
        while True:
            await asyncio.sleep(every)
            try:
                for delivery in self.held:
                    await delivery.msg.in_progress()
            except BROKER_ERRORS as e:  # a broker restart: the next round tells it again
                log.warning("inbox.keep_alive_failed", reason=repr(e))

    async def ack_held(self) -> int:
        """Ack every held message, waiting for the broker to confirm each; returns how many it
        did not. Those are offered again (after a broker restart, acks for deliveries made
        before it go unanswered): the trainer skips them then, by their sequences."""
        unconfirmed = 0
        for delivery in self.held:
            for attempt in range(ACK_ATTEMPTS):
                try:
                    await delivery.msg.ack_sync(timeout=1.0)
                    break
                except BROKER_ERRORS as e:
                    log.warning("inbox.ack_failed", seq=delivery.seq, reason=repr(e), attempt=attempt)
            else:
                unconfirmed += 1
        self.held.clear()
        return unconfirmed

    async def counts(self) -> ConsumerCounts:
        info = await self.subscription.consumer_info()
        return ConsumerCounts(ack_floor=info.ack_floor.stream_seq, published=info.delivered.stream_seq + info.num_pending,
                              pending=info.num_pending + info.num_ack_pending)
