"""The trainer's rollout inbox: every JetStream delivery mechanic of its readers (one durable
pull consumer per sampler subject) on the rollouts stream. The trainer sees deliveries (a stream
sequence, a subject, headers, an encoded group) and says when its step is checkpointed; this
module fetches, takes the samplers in turn, holds each message unacked until then, keeps held
messages alive through a long step, acks them with the broker's confirmation, and reads the
readers' counts for the run's accounting.

Samplers are read in turn, one message of each with messages waiting, so no sampler's backlog
(a flood of junk included) stands in front of another's: one consumer over every subject
delivered in stream order, and a sampler that kept its quota full held every honest group behind
its own.

Nothing waits out ack_wait: when the inbox opens (a previous trainer's deliveries are in flight)
and after its connection dropped (a broker restart, a cut link: a fetch's messages lost with it,
acks for deliveries made before it unanswered), it resets its readers to their ack floors, and
every unacked message is offered again at once; the trainer skips those it already counted by
their sequences.

Which readers have messages is learnt from a headers-only watch of the stream (every message's
subject and sequence, in order), so a round fetches from those alone: listing the readers' states
instead cost about 700 bytes a sampler a round, a fifth of the trainer's CPU at 1,000 samplers."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg

from echo.wire.codec import RolloutLimits, decode_rollout
from echo.wire.messages import RolloutGroup
from echo.wire.names import ROLLOUT_MESSAGE_MAX, subject_sampler
from streams.client import BROKER_ERRORS, RunClient
from streams.rollouts import (
    fetch_rollouts,
    last_rollout_seq,
    late_rollouts,
    reader_name,
    reader_subscription,
    readers,
    reset_reader,
    rollout_body,
    rollout_subjects,
    watch_rollouts,
)

log = structlog.get_logger()

ACK_ATTEMPTS = 3  # a held message's ack is confirmed, or left for the broker to offer again
# What one round of fetches may have the server send: half its max_pending for one client
# (64 MB), so that a round of the largest messages never makes it close the trainer's connection
# (the batch lost with it came back only after ack_wait).
FETCH_BYTES = 32 << 20
FETCH_MAX = FETCH_BYTES // ROLLOUT_MESSAGE_MAX  # messages one round asks the server for, all readers together
# A reader with messages answers at once, however busy the box; this bounds only one whose every
# announced message was evicted before its fetch (a fetch on an empty consumer waits it out).
PULL_TIMEOUT_S = 5.0
SNAPSHOT_TRIES = 50  # counts read again while samplers publish between the reads


@dataclass(frozen=True)
class Delivery:
    """One rollout message as the stream delivered it."""

    seq: int  # its stream sequence: the same message offered again has the same one
    subject: str
    headers: dict[str, str]
    msg: Msg = field(repr=False)
    run: RunClient = field(repr=False, compare=False)  # where a large group's parts are read
    arrived: float = 0.0  # when the broker stored it, on this process's monotonic clock
    connection: int = 0  # the trainer's connection it came on (its count of reconnects then)

    @property
    def sampler_id(self) -> str:
        """The sampler whose subject it came on (its credentials allow it no other; its group,
        decoded, names the same one or is refused)."""
        return subject_sampler(self.subject)

    async def group(self, limits: RolloutLimits | None = None) -> RolloutGroup:
        """Its group, decoded within `limits` from its own data or a large group's parts
        (ProtocolError with the reason: "too_large" before a part is read, "bad_body", ...)."""
        body = await rollout_body(self.run.js, self.run.names, self.msg, limits)
        return decode_rollout(body, self.headers, self.subject, limits)


@dataclass(frozen=True)
class ConsumerCounts:
    """The readers' counts at one instant."""

    ack_floor: int  # every stream sequence up to this one is acked (or gone)
    published: int  # the stream's last sequence: every message ever stored on it
    pending: int  # not yet delivered, or delivered and not acked
    exact: bool = True  # False: samplers published between the reads every time


@dataclass
class Reader:
    """One sampler subject's consumer, and what it delivered that the inbox has not handed out."""

    subscription: object
    name: str  # its consumer's
    waiting: list[Msg] = field(default_factory=list)
    # The stream sequence it has delivered through: a message of its subject announced past it is
    # still to fetch (delivered in order; one announced and never delivered was evicted).
    through: int = 0
    # Its place in the turn, the lowest first: given when it is bound, and again (at the back)
    # each time one of its messages is handed out.
    turn: int = 0


class RolloutInbox:
    def __init__(self, run: RunClient, ack_wait_s: float):
        self.run, self.ack_wait_s = run, ack_wait_s
        self.held: list[Delivery] = []  # fetched and not yet acked
        self.untrained: set[int] = set()  # the sequences of held messages let go (not trained)
        self.readers: dict[str, Reader] = {}  # by subject
        self.ready: set[str] = set()  # the subjects whose readers have messages waiting
        # Those whose last fetch waited out its expiry: the rest of its answer (a message of the
        # last instant, or the expiry's status) may still come, queued on the subscription.
        self.gave_up: set[str] = set()
        self.turns = itertools.count()
        self.connection = -1  # the connection the readers were last reset on: none yet
        self.watch = None  # the stream's headers-only watch (watch_rollouts), on that connection
        # By subject: the sequences the watch announced past its reader's `through`, to fetch.
        self.announced: dict[str, list[int]] = {}
        self.woken = asyncio.Event()  # set by each announcement
        # While the watch replays what the stream held when it began, nothing is fetched: the
        # first round sees every sampler's backlog, and no flood of one stands in front of another.
        self.replaying, self.replay_to = True, 0

    @classmethod
    async def open(cls, run: RunClient, ack_wait_s: float = 600.0) -> "RolloutInbox":
        inbox = cls(run, ack_wait_s)
        await inbox._reset_if_reconnected()
        return inbox

    def _reconnects(self) -> int:
        return self.run.nc.stats["reconnects"]

    async def _bind_readers(self) -> int:
        """A reader on every subject the stream holds messages on; returns its last sequence then."""
        last_seq, subjects = await rollout_subjects(self.run)
        for subject in subjects:
            await self._bind(subject)
        return last_seq

    async def _bind(self, subject: str) -> Reader:
        if subject not in self.readers:
            subscription = await reader_subscription(self.run, subject, self.ack_wait_s)
            self.readers[subject] = Reader(subscription, reader_name(self.run.names, subject), turn=next(self.turns))
        return self.readers[subject]

    async def _reset_if_reconnected(self) -> None:
        """On a connection the readers were not reset on yet, offer every unacked message again,
        and watch the stream from the oldest of them."""
        if self.connection == self._reconnects():
            return
        try:
            # Read before the readers are bound: a subject first published after it is announced.
            last_seq = await last_rollout_seq(self.run)
            await self._bind_readers()
            for reader in self.readers.values():
                await reset_reader(self.run, reader.name)
                reader.waiting.clear()
            self.ready.clear()
            await self._watch_from(last_seq, {state.name: state for state in await readers(self.run)})
            self.connection = self._reconnects()
        except BROKER_ERRORS as e:  # still reconnecting: the next fetch tries again
            log.warning("inbox.reset_failed", reason=repr(e))

    async def _watch_from(self, last_seq: int, states: dict) -> None:
        """Watch the stream from the oldest message a reader still holds unacked. A reader holding
        none has delivered its subject through `last_seq`; one holding some, through its ack floor
        (acked messages above the floor are announced too, and found gone by its fetch)."""
        start = last_seq + 1
        for reader in self.readers.values():
            state = states.get(reader.name)
            holding = state is not None and state.num_pending + state.num_ack_pending > 0
            reader.through = state.ack_floor_seq if holding else last_seq
            if holding:
                start = min(start, reader.through + 1)
        if self.watch is not None:
            try:
                await self.watch.unsubscribe()
            except BROKER_ERRORS as e:  # the old connection's: gone with it
                log.warning("inbox.unwatch_failed", reason=repr(e))
        self.announced.clear()
        self.replaying, self.replay_to = start <= last_seq, last_seq
        self.watch = await watch_rollouts(self.run, start, self._arrived)

    async def _arrived(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        self.announced.setdefault(msg.subject, []).append(seq)
        if seq >= self.replay_to or msg.metadata.num_pending == 0:
            self.replaying = False
        self.woken.set()

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to `batch` deliveries ([] when none came within `timeout`), each held until ack_held,
        taken from the samplers in turn. A round of fetches asks the server for every sampler's
        share of a full fetch (FETCH_MAX, FETCH_BYTES of the largest messages) whatever `batch`
        is, the rest kept for the next calls: a backlog is read a full fetch at a time. Idle, it
        waits for the watch's announcements alone: a fetch that gave up (PULL_TIMEOUT_S) is
        looked at again by the next call. Looking every 0.1 s besides, with the quarantine read as
        often (streams/quarantine.py), was most of an idle trainer's wake-ups, paid each second a
        step waits on a large fleet (bench.load, 2026-12-07)."""
        deadline = time.monotonic() + timeout
        await self._reset_if_reconnected()
        while not self.ready:
            self.woken.clear()
            if not await self._pull():
                if time.monotonic() >= deadline:
                    return []
                try:
                    await asyncio.wait_for(self.woken.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
        now, wall, connection = time.monotonic(), time.time(), self._reconnects()
        deliveries = [Delivery(msg.metadata.sequence.stream, msg.subject, msg.headers or {}, msg, self.run,
                               arrived=now - max(0.0, wall - msg.metadata.timestamp.timestamp()),
                               connection=connection)
                      for msg in self._in_turn(batch)]
        self.held += deliveries  # acked after the checkpoint, used or not; they stay in the stream for replay
        return deliveries

    async def _pull(self) -> bool:
        """One round: every reader with messages announced, or queued late, fetches its share of a
        full fetch, all at once; True when any came. A reader with none is not asked (a fetch on
        one waits out its expiry). A fetch that brings fewer than it asked for found its reader
        empty: the rest of what was announced before it was evicted. Each round costs what the
        readers with news cost: scanning every reader, it was a tenth of the trainer's CPU at
        1,000 samplers (py-spy)."""
        if self.replaying:
            return False
        late = self._late()
        try:
            for subject in [subject for subject in self.announced if subject not in self.readers]:
                await self._bind(subject)  # a new sampler's: all its messages announced
        except BROKER_ERRORS as e:  # a broker restarting: the next round asks again
            log.warning("inbox.pull_failed", reason=repr(e))
            return False
        # One announced while another's reader was being bound has none yet: bound next round.
        news = [subject for subject in self.announced.keys() | late.keys() if subject in self.readers]
        counts = []
        for subject in sorted(news, key=lambda subject: self.readers[subject].turn):
            known, reader = self.announced.get(subject, []), self.readers[subject]
            if count := sum(seq > reader.through for seq in known) + late.get(subject, 0):
                counts.append((subject, count, max(known, default=0)))
        ready = counts[:FETCH_MAX]
        share = FETCH_MAX // max(1, len(ready))
        asked = [min(share, count) for _, count, _ in ready]
        fetched = await asyncio.gather(*(self._fetch(subject, n) for (subject, _, _), n in zip(ready, asked)))
        for (subject, _, newest), n, msgs in zip(ready, asked, fetched):
            reader = self.readers[subject]
            reader.waiting += msgs
            reader.through = max([reader.through, *(msg.metadata.sequence.stream for msg in msgs)])
            if len(msgs) < n:
                reader.through = max(reader.through, newest)
            if msgs:
                self.ready.add(subject)
        self._forget_delivered()
        return any(fetched)

    def _late(self) -> dict[str, int]:
        """By subject, the messages queued for fetches that gave up waiting (late_rollouts)."""
        late = {}
        for subject in list(self.gave_up):
            count = late_rollouts(self.readers[subject].subscription)
            if count is not None:  # the fetch's answer came
                self.gave_up.discard(subject)
                if count:
                    late[subject] = count
        return late

    async def _fetch(self, subject: str, batch: int) -> list[Msg]:
        began = time.monotonic()
        msgs = await fetch_rollouts(self.readers[subject].subscription, batch, PULL_TIMEOUT_S)
        if time.monotonic() - began >= PULL_TIMEOUT_S:
            self.gave_up.add(subject)
        return msgs

    def _forget_delivered(self) -> None:
        for subject in list(self.announced):
            reader = self.readers.get(subject)
            if reader is not None:
                if not (left := [seq for seq in self.announced[subject] if seq > reader.through]):
                    del self.announced[subject]
                else:
                    self.announced[subject] = left

    def _in_turn(self, batch: int) -> list[Msg]:
        """Up to `batch` waiting messages, one from each sampler in turn (the least recently
        served first)."""
        taken: list[Msg] = []
        while len(taken) < batch and self.ready:
            for subject in sorted(self.ready, key=lambda subject: self.readers[subject].turn)[: batch - len(taken)]:
                reader = self.readers[subject]
                taken.append(reader.waiting.pop(0))
                reader.turn = next(self.turns)
                if not reader.waiting:
                    self.ready.discard(subject)
        return taken

    def let_go(self, delivery: Delivery) -> None:
        """Its body is no longer needed (the group is not trained): only its ack is kept until the
        checkpoint, so a step's memory holds the groups it trains, however many it refuses."""
        delivery.msg.data = b""
        self.untrained.add(delivery.seq)

    async def keep_alive(self, every: float) -> None:
        """Tell the server the held and waiting messages are still being worked on, so a long
        step does not get them redelivered, while a crashed trainer's are redelivered after one
        ack_wait (or at once, when its successor opens the inbox)."""
        while True:
            await asyncio.sleep(every)
            try:
                waiting = [msg for subject in self.ready for msg in self.readers[subject].waiting]
                for msg in [*(delivery.msg for delivery in self._on_this_connection()), *waiting]:
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
        """The readers' counts and the stream's last sequence at one instant: read again while
        samplers publish between the reads (a message stored meanwhile would be published and in
        no reader's counts). The ack floor is the lowest of the readers that still hold messages;
        past every reader's messages, the stream's last sequence."""
        for _ in range(SNAPSHOT_TRIES):
            last_seq = await self._bind_readers()
            infos = await readers(self.run)
            exact = await last_rollout_seq(self.run) == last_seq
            if exact:
                break
        holding = [info for info in infos if info.num_pending + info.num_ack_pending]
        return ConsumerCounts(ack_floor=min((info.ack_floor_seq for info in holding), default=last_seq),
                              published=last_seq, pending=sum(info.num_pending + info.num_ack_pending for info in infos),
                              exact=exact)
