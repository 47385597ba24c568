"""The trainer's rollout inbox: every JetStream delivery mechanic of its durable pull consumer
on the rollouts stream. The trainer sees deliveries (a stream sequence, a subject, headers, an
encoded group) and says when its step is checkpointed; this module fetches, holds each message
unacked until then, keeps held messages alive through a long step, acks them with the broker's
confirmation, and reads the consumer's counts for the run's accounting.

Nothing waits out ack_wait: when the inbox opens (a previous trainer's deliveries are in flight)
and after its connection dropped (a broker restart, a cut link: a fetch's messages lost with it,
acks for deliveries made before it unanswered), it resets the consumer to its ack floor, and
every unacked message is offered again at once; the trainer skips those it already counted by
their sequences."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg

from echo.protocol import ROLLOUT_MESSAGE_MAX, RolloutLimits, subject_sampler
from streams.client import BROKER_ERRORS, Run
from streams.rollouts import fetch_rollouts, reset_trainer_consumer, rollout_body, trainer_subscription

log = structlog.get_logger()

ACK_ATTEMPTS = 3  # a held message's ack is confirmed, or left for the broker to offer again
# What one fetch may have the server send: half its max_pending for one client (64 MB), so that
# a fetch of the largest messages never makes it close the trainer's connection (the batch lost
# with it came back only after ack_wait).
FETCH_BYTES = 32 << 20
FETCH_MAX = FETCH_BYTES // ROLLOUT_MESSAGE_MAX  # messages one fetch asks the server for


@dataclass(frozen=True)
class Delivery:
    """One rollout message as the stream delivered it."""

    seq: int  # its stream sequence: the same message offered again has the same one
    subject: str
    headers: dict[str, str]
    msg: Msg = field(repr=False)
    arrived: float = 0.0  # when the broker stored it, on this process's monotonic clock
    connection: int = 0  # the trainer's connection it came on (its count of reconnects then)

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
        self.untrained: set[int] = set()  # the sequences of held messages let go (not trained)
        # Delivered beyond a fetch's batch (nats-py returns whatever its subscription queued, a
        # pull request it gave up on included): handed out by the next fetches, first.
        self.waiting: list[Msg] = []
        self.connection = -1  # the connection the consumer was last reset on: none yet

    @classmethod
    async def open(cls, run: Run, ack_wait_s: float = 600.0) -> "RolloutInbox":
        inbox = cls(run, await trainer_subscription(run, ack_wait_s))
        await inbox._reset_if_reconnected()
        return inbox

    def _reconnects(self) -> int:
        return self.run.nc.stats["reconnects"]

    async def _reset_if_reconnected(self) -> None:
        """On a connection the consumer was not reset on yet, offer every unacked message again."""
        if self.connection == self._reconnects():
            return
        try:
            await reset_trainer_consumer(self.run)
            self.connection = self._reconnects()
            self.waiting.clear()  # offered again
        except BROKER_ERRORS as e:  # still reconnecting: the next fetch tries again
            log.warning("inbox.reset_failed", reason=repr(e))

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to `batch` deliveries ([] when none came within `timeout`), each held until ack_held.
        The server is asked for a full fetch (FETCH_MAX, FETCH_BYTES of the largest messages)
        whatever `batch` is, the rest kept for the next calls: a backlog, one sampler's flood of
        junk included, is read a full fetch at a time, not a step's few groups at a time."""
        await self._reset_if_reconnected()
        if not self.waiting:
            self.waiting = await fetch_rollouts(self.subscription, FETCH_MAX, timeout)
        msgs, self.waiting = self.waiting[:batch], self.waiting[batch:]
        now, wall, connection = time.monotonic(), time.time(), self._reconnects()
        deliveries = [Delivery(msg.metadata.sequence.stream, msg.subject, msg.headers or {}, msg,
                               arrived=now - max(0.0, wall - msg.metadata.timestamp.timestamp()),
                               connection=connection)
                      for msg in msgs]
        self.held += deliveries  # acked after the checkpoint, used or not; they stay in the stream for replay
        return deliveries

    def let_go(self, delivery: Delivery) -> None:
        """Its body is no longer needed (the group is not trained): only its ack is kept until the
        checkpoint, so a step's memory holds the groups it trains, however many it refuses."""
        delivery.msg.data = b""
        self.untrained.add(delivery.seq)

    async def body(self, delivery: Delivery, limits: RolloutLimits | None = None) -> bytes:
        """Its encoded group: its own data, or a large group's parts (ProtocolError "bad_body";
        "too_large" before a part is read, for a size beyond `limits`)."""
        return await rollout_body(self.run.js, self.run.names, delivery.msg, limits)

    async def keep_alive(self, every: float) -> None:
        """Tell the server the held and waiting messages are still being worked on, so a long
        step does not get them redelivered, while a crashed trainer's are redelivered after one
        ack_wait (or at once, when its successor opens the inbox)."""
        while True:
            await asyncio.sleep(every)
            try:
                for msg in [*(delivery.msg for delivery in self._on_this_connection()), *self.waiting]:
                    await msg.in_progress()
            except BROKER_ERRORS as e:  # a broker restart: the next round tells it again
                log.warning("inbox.keep_alive_failed", reason=repr(e))

    async def ack_held(self) -> int:
        """Ack every held message, all at once; returns how many acks the broker did not confirm.
        Those are offered again and the trainer skips them then, by their sequences: deliveries
        made on a connection since dropped are not acked at all (their acks would go unanswered
        after a broker restart, a second each), the reset offers them again. The trained groups'
        acks are confirmed one by one; the others' are sent unconfirmed: a sampler chooses how
        many of those there are (16,400 junk messages took 32 s to ack with a confirmation each,
        0.3 s without), and a lost one costs only a skip when it is offered again."""
        trained, untrained = [], 0
        for delivery in self._on_this_connection():
            if delivery.seq not in self.untrained:
                trained.append(delivery)
            else:
                untrained += await self._ack_unconfirmed(delivery)
        acked = await asyncio.gather(*(self._ack(delivery) for delivery in trained))
        unconfirmed = len(self.held) - untrained - sum(acked)
        self.held.clear()
        self.untrained.clear()
        return unconfirmed

    def _on_this_connection(self) -> list[Delivery]:
        return [delivery for delivery in self.held if delivery.connection == self._reconnects()]

    @staticmethod
    async def _ack(delivery: Delivery) -> bool:
        for attempt in range(ACK_ATTEMPTS):
            try:
                await delivery.msg.ack_sync(timeout=1.0)
                return True
            except BROKER_ERRORS as e:
                log.warning("inbox.ack_failed", seq=delivery.seq, reason=repr(e), attempt=attempt)
        return False

    @staticmethod
    async def _ack_unconfirmed(delivery: Delivery) -> bool:
        try:
            await delivery.msg.ack()
            return True
        except BROKER_ERRORS as e:
            log.warning("inbox.ack_failed", seq=delivery.seq, reason=repr(e))
            return False

    async def counts(self) -> ConsumerCounts:
        info = await self.subscription.consumer_info()
        return ConsumerCounts(ack_floor=info.ack_floor.stream_seq, published=info.delivered.stream_seq + info.num_pending,
                              pending=info.num_pending + info.num_ack_pending)
