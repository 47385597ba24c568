"""The trainer's lease on a run (TrainerLease under TRAINER_KEY in the state bucket).

One trainer owns a run at a time. A trainer starting takes the next term with a compare-and-set;
if the lease is held and being renewed, another trainer is alive and this one refuses to start;
if it stops being renewed (the holder died) it lapses and the new trainer takes over, at once
when it can see that the holder's process has exited (restarted on the same machine). Versions
are ordered by (term, version), so a restarted trainer's announcements supersede everything of
its predecessor's, even a version number forged far ahead."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time

import structlog
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from echo.process.lifeline import exited, process_name
from echo.wire.codec import ProtocolError, decode, encode
from echo.wire.messages import TrainerLease, WeightsAnnouncement
from echo.wire.names import TRAINER_KEY
from streams.client import BROKER_ERRORS, RunClient
from streams.watch import read_value

log = structlog.get_logger()

_DECODE_LEASE = functools.partial(decode, TrainerLease)

RENEW_S = 1.0
LAPSE_S = 4.0  # a lease not renewed for this long (by a clock on this side) belongs to a dead trainer
# A trainer acts on the run (checkpoints, announces weights) only within this long of sending
# its last renewal the broker confirmed: a standby takes over no sooner than LAPSE_S after that
# renewal landed, so the two never work at once. (A cluster node's death failed renewals for
# ~4 s while the trainer went on.)
HELD_S = LAPSE_S / 2


class AnotherTrainer(RuntimeError):
    pass


class Lease:
    def __init__(self, run: RunClient, lease: TrainerLease, revision: int):
        self.run, self.lease, self.revision = run, lease, revision
        self.lost: BaseException | None = None
        # When the last renewal the broker confirmed was sent; None until renew_forever runs (a
        # lease no process renews is held as long as its taker likes: tests, tools).
        self.renewed_at: float | None = None

    @property
    def term(self) -> int:
        return self.lease.term

    async def renew_forever(self) -> None:
        """Renew until another trainer takes the run. A renewal that fails on the way (a broker
        restart) is tried again: the lease lapses only if this trainer stays away past LAPSE_S,
        and then the next compare-and-set tells it it was fenced out."""
        self.renewed_at = time.monotonic()  # taken or confirmed just before
        while True:
            await asyncio.sleep(RENEW_S)
            sent = time.monotonic()
            try:
                self.revision = await self.run.state.update(TRAINER_KEY, encode(self.lease), last=self.revision)
                self.renewed_at = sent
            except KeyWrongLastSequenceError:
                if await self._still_ours():
                    continue
                self.lost = AnotherTrainer(f"run {self.run.names.run_id}: another trainer took over term {self.term}")
                log.error("trainer.fenced_out", term=self.term)
                raise self.lost  # at once: the process exits non-zero (workers/background.py)
            except BROKER_ERRORS as e:
                log.warning("trainer.lease_renewal_failed", term=self.term, error=repr(e))

    async def _still_ours(self) -> bool:
        """The key moved under a renewal: it is still this lease when its value is ours (a renewal
        that timed out here was applied after all, or a broker killed mid-write came back with an
        older revision); another trainer would have written the next term. Takes its revision."""
        try:
            held, revision = await read_value(self.run.state, TRAINER_KEY, _DECODE_LEASE)
        except BROKER_ERRORS as e:  # not known yet: the next renewal asks again
            log.warning("trainer.lease_renewal_failed", term=self.term, error=repr(e))
            return True
        if held != self.lease:  # another's, gone, or unreadable: the run's state is not what this trainer knew
            return False
        log.warning("trainer.lease_revision_moved", term=self.term, expected=self.revision, found=revision)
        self.revision = revision
        return True

    async def held(self) -> None:
        """Return once this trainer may act on the run (its lease renewed within HELD_S); wait
        meanwhile, and raise if another trainer took the run."""
        unconfirmed = False
        while self.renewed_at is not None and time.monotonic() - self.renewed_at >= HELD_S:
            self.check()
            if not unconfirmed:
                unconfirmed = True
                log.warning("trainer.lease_unconfirmed", term=self.term, waiting=True,
                            renewed_s_ago=round(time.monotonic() - self.renewed_at, 1))
            await asyncio.sleep(RENEW_S / 4)
        self.check()

    def check(self) -> None:
        """Raise if another trainer took the run: this one must not publish any more."""
        if self.lost is not None:
            raise self.lost

    async def release(self) -> None:
        released = self.lease.model_copy(update={"released": True})
        try:
            await self.run.state.update(TRAINER_KEY, encode(released), last=self.revision)
        except KeyWrongLastSequenceError:
            pass  # taken over already: nothing of ours to release


async def take_lease(run: RunClient, lapse_s: float = LAPSE_S) -> Lease:
    """Take the run's next term. A held lease is watched for `lapse_s`: renewed, it belongs to a
    live trainer (AnotherTrainer); not renewed, its holder died and the run is taken over. A
    holder this process sees has exited (a trainer restarted on its machine) is not waited for."""
    loop = asyncio.get_running_loop()
    watched: tuple[int, float] | None = None  # (revision seen, when)
    while True:
        held, revision = await read_value(run.state, TRAINER_KEY, _DECODE_LEASE)
        if held is not None and not held.released and exited(held.process):
            log.info("trainer.lease_holder_exited", holder=held.holder, term=held.term)
        elif revision and (held is None or not held.released):  # an unreadable lease is watched as a held one
            holder = f"{held.holder}, term {held.term}" if held else "its lease unreadable"
            if watched is None:
                watched = (revision, loop.time())
                log.info("trainer.lease_held", holder=holder, waiting_s=lapse_s)
            elif revision != watched[0]:
                raise AnotherTrainer(f"run {run.names.run_id} has a live trainer ({holder})")
            if loop.time() - watched[1] < lapse_s:
                await asyncio.sleep(RENEW_S / 4)
                continue
        term = held.term if held else await _last_announced_term(run) if revision else 0
        lease = TrainerLease(term=term + 1, holder=f"{socket.gethostname()}:{os.getpid()}", process=process_name())
        try:
            if revision == 0:
                revision = await run.state.create(TRAINER_KEY, encode(lease))
            else:
                revision = await run.state.update(TRAINER_KEY, encode(lease), last=revision)
        except KeyWrongLastSequenceError:
            raise AnotherTrainer(f"run {run.names.run_id}: another trainer started at the same moment") from None
        return Lease(run, lease, revision)


async def current_term(run: RunClient) -> int | None:
    """The term of the run's trainer, or None before any trainer started (or its lease unreadable)."""
    held, _ = await read_value(run.state, TRAINER_KEY, _DECODE_LEASE)
    return held.term if held else None


async def _last_announced_term(run: RunClient) -> int:
    """The term of the newest weights announcement (0: none readable): after an unreadable lease
    the next term comes after every one samplers have seen."""
    try:
        last = await run.js.get_last_msg(run.names.control_stream, run.names.weights_subject)
        return decode(WeightsAnnouncement, last.data).term
    except (NotFoundError, ProtocolError):
        return 0
