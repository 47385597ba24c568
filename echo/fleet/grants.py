"""Async mode's grant budget: how many groups samplers may generate so that none arrives
stale. Pure arithmetic; streams/grants.py keeps the numbers in KV.

A slot is one group the trainer granted a sampler to generate. Slots are numbered 1, 2, 3, ...
in the order samplers take them, and the trainer consumes groups roughly in that order, B =
groups_per_step per step. A group whose slot is number n is consumed by
step ceil(n / B) (plus the groups lost on the way). Generated with version w, it is fresh at that
step if ceil(n / B) - 1 <= w + S. So a sampler running version w may take slot n only while
n <= (w + S + 1) * B + lost, where lost counts slots that will never be trained: their group
arrived stale or rejected, or their holder died or stalled. The trainer publishes that number
for its own version v; a sampler still running an older w shifts it down by (v - w) * B.

Lost is counted from what is really out, every step (`lost_slots`), not added up as losses
happen: a released slot whose group came after all and was trained, or a trained group that
held no slot (a previous trainer's grant, a forged one), would otherwise leave one group too
many in flight for the rest of the run. So the groups in flight (slots out plus headroom) come
back to the window (S + 1) * B whatever arrives.

The trainer alone grants slots (GrantLedger), and no sampler may hold more than its share of
the groups that may be in flight: one that takes work and never delivers (dead or malicious)
blocks its share, never the whole window, and only until its heartbeat stops or it has
delivered nothing for a while; then its slots, and only those, are lost and handed out again.
Junk that never held a slot changes nothing.

A sampler that keeps back the groups it dislikes (low reward) biases training without forging
anything; the prompt is owed and granted again, but the completions trained are its survivors.
An honest sampler delivers its slots in the order they were granted (one call at a time, each
call's groups published in slot order), and loses slots only to faults: a crash, a restart, a
lost answer to a request for work. So each sampler's slots that end undelivered (passed over by
a later one of its own, or held when it stopped, restarted, died or stalled) are counted
(`Deliveries`), and past `DeliveryBound` in its last slots it is struck.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from echo.fleet.throughput import CallWindow, Rates

ACTIVE_S = 30.0  # a sampler that asked for work this recently shares the window
STALL_CALLS = 4  # a holder that has filled none of its slots for this many of its calls' time is stalled
SYNC_SAMPLES = 8  # a sampler's observed sync time: the least of its last this many
# A sampler's pace: its seconds a token over its last this many calls delivered within the last
# so many seconds (one judged too slow is tried again after), each from the grant to its last
# group's arrival, over its longest completion: a call's groups decode together, in the time of
# its longest. Waits and latency count as tokens' time: it errs slow.
PACE_SAMPLES, PACE_KEPT_S = 8, 600.0
# A long group: this quantile of the longest completions of the fleet's last so many groups (any
# sampler's, stale ones included). Not a typical one: the long completions are the ones that
# arrive stale, and they hold most of the tokens (a sampler's usual time fitted where its long
# groups went stale: a tenth of the tokens at 256 samplers, docs/performance.md).
LONG_SAMPLES, LONG_QUANTILE = 256, 0.95
# A version's deadline is judged at this share of the lower quartile of the trainer's recent
# steps' times, erring short: the steps shorten as work moves to the faster samplers. At 256
# samplers the quartile alone let 5% of the tokens go stale in a run's second half; with this
# share, 0.1% (docs/performance.md).
STEP_SHARE = 0.8
# While the fleet joins, before the trainer's pace is known, a sampler not yet measured is judged
# by the pace it claims against the fleet's claims: a crowd of at least this many. Its first
# window went to whoever asked first, and the slowest half's groups were half of a run's waste
# at 256 samplers (docs/performance.md).
JOINING_CLAIMS_MIN = 8
# Asks a second, in all, a trainer takes from samplers told "work is left, not yours yet" and the
# soonest one asks again; and from those told "none is left", who wait for the next budget and
# ask regardless only in case they missed it (a thousand asking every 5 s were 200 requests a
# second, thousands a step at that size).
ASKS_PER_S, ASK_AGAIN_MIN_S = 200.0, 0.2
IDLE_ASKS_PER_S, IDLE_ASK_MIN_S = 10.0, 5.0
# Idle samplers a budget wakes per slot open: some of those drawn ask late (a slow uplink, a
# version behind), and the busy ask anyway as they finish. A budget woke every idle sampler: a
# thousand asks a step for 128 slots, the trainer's largest cost that grew with the samplers.
DRAWN_PER_OPEN_SLOT = 2.0
REDRAW_S = 1.0  # open slots nobody took for this long: the trainer draws other idle samplers


def ask_again_s(asking: int, more: bool = True) -> float:
    """How long a sampler granted nothing waits before it asks again (`more`: work is left, not
    yours yet; else none is left, and a new budget wakes it sooner): the `asking` samplers' asks
    spread to ASKS_PER_S (IDLE_ASKS_PER_S) a second in all, never sooner than ASK_AGAIN_MIN_S
    (IDLE_ASK_MIN_S). A thousand asking every 0.2 s drowned the trainer in 5,000 requests a second."""
    if more:
        return max(ASK_AGAIN_MIN_S, asking / ASKS_PER_S)
    return max(IDLE_ASK_MIN_S, asking / IDLE_ASKS_PER_S)


def ask_share(open_slots: int, idle: int) -> float:
    """The share of `idle` samplers a budget with `open_slots` wakes to ask (idle 0: unknown, all)."""
    return 1.0 if idle <= 0 else min(1.0, DRAWN_PER_OPEN_SLOT * open_slots / idle)


def drawn_to_ask(sampler_id: str, version: int, draw: int, share: float) -> bool:
    """Whether a budget's draw wakes `sampler_id`: a hash, so each draw wakes a different share
    of the idle samplers and every one is drawn as often. The draw is advice: a sampler that
    ignores it and asks anyway is granted no more than its share, as any asker is."""
    digest = hashlib.sha256(f"{sampler_id}/{version}/{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") < share * 2**64


def slot_prompt(seed: int, slot: int) -> int:
    """The prompt index the trainer draws for a new slot: the run's seed and the slot's number,
    hashed (a restarted trainer draws as its predecessor did), below 2**31 like any task's index."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{slot}".encode()).digest()[:4], "little") >> 1


def allowance(version: int, max_staleness: int, groups_per_step: int, lost: int) -> int:
    """The highest slot number a sampler running `version` may take."""
    return (version + max_staleness + 1) * groups_per_step + lost


def lost_slots(issued: int, outstanding: int, version: int, groups_per_step: int, accepted: int) -> int:
    """Slots that will never be trained: every slot issued is out, trained (at `version`, version
    x B groups were), accepted for the step being collected, or lost. Negative when groups that
    held no slot were trained in their place: the window then closes by as many."""
    return issued - outstanding - version * groups_per_step - accepted


def sampler_cap(budget_version: int, budget_allowance: int, sampler_version: int, groups_per_step: int) -> int:
    """The allowance for a sampler whose weights are at `sampler_version`."""
    return budget_allowance - (budget_version - sampler_version) * groups_per_step


@dataclass(frozen=True)
class DeliveryBound:
    """How many of a sampler's last `window` ended slots may go undelivered before it is struck
    (trainer.undelivered_share, trainer.undelivered_window): more than share x window."""

    window: int = 64
    share: float = 0.125

    @property
    def most(self) -> int:
        return math.floor(self.share * self.window)


@dataclass
class Deliveries:
    """One sampler's ended slots, and those of them it never delivered."""

    ended: int = 0
    undelivered: int = 0
    recent: deque = field(default_factory=deque)  # its last slots' outcomes (True: undelivered), since its last strike


@dataclass
class _Call:
    """One grant, as the trainer sees its sampler work through it."""

    sampler_id: str
    granted_at: float
    open: int  # its slots neither accepted, wasted nor given up yet
    accepted: int = 0
    last_at: float = 0.0  # its latest group's arrival
    version: int | None = None  # the version its sampler said it ran when it asked
    longest: int = 0  # tokens in the longest completion of its groups delivered


class GrantLedger:
    """Every slot the trainer granted and has not yet received, by number and holder.

    A slot ends when a group naming it arrives from its holder (`delivered`). One that arrives
    and is not trained (stale, rejected) is wasted; one whose holder died or stalled is
    released: both are lost, reported once by `take_lost` so the trainer hands the work out
    again. A group naming no slot of its sender's (junk, a previous trainer's grant) changes
    nothing here.

    Each slot is granted with its prompt (the trainer's draw, `slot_prompt`), and a lost slot's
    prompt is owed: the next slot granted takes it, with the keyed noise of the slot it was first
    granted on (`noise_slot`). So a sampler cannot choose what the policy learns from, neither by
    naming prompts nor by letting the ones it dislikes go: the prompt comes back drawn alike.

    Each grant is a call the trainer measures itself, from the grant to its last group's
    arrival in the stream, counting only the groups it accepted (`measured`): the scheduler
    plans from what a sampler delivered, not from what its heartbeat claims. So is each
    sampler's sync time (`synced`): from a version's announcement to the sampler's first request
    for work naming it (a sampler asks once it runs the version; one busy with a call asks after
    it, so the least of its last SYNC_SAMPLES is taken)."""

    def __init__(self, issued: int = 0, active_s: float = ACTIVE_S, rate_window_s: float = 60.0, seed: int = 0,
                 bound: DeliveryBound | None = None, max_tokens: int = 0):
        self.issued = issued  # slots numbered so far in the run, in every term of the trainer
        self.seed = seed  # the run's: slot_prompt's
        self.prompts: dict[int, int] = {}  # slot number -> the prompt index it was granted with, until it settles
        # (prompt, noise slot) of lost slots, granted again first with the noise they were first
        # granted with: a redraw is the same draw, so a sampler cannot choose among a prompt's draws.
        self.owed: deque[tuple[int, int]] = deque()
        self.noise: dict[int, int] = {}  # slot number -> the slot whose keyed noise it draws with, where not its own
        self.earlier: range = range(0)  # a predecessor's last slots, whose groups may still come (resume)
        self._earlier_taken: set[int] = set()
        self.active_s, self.rate_window_s = active_s, rate_window_s
        self.outstanding: dict[int, str] = {}  # slot number -> the sampler holding it
        self._holding: dict[str, set[int]] = {}  # the same by sampler: no scan of every slot out a grant
        self.asked_at: dict[str, float] = {}
        self.granted_at = 0.0  # the last grant of any slot
        # who asked within active_s, oldest first: how many share the work, with no scan of every
        # sampler a grant (a thousand samplers asking each step made that a million a step)
        self._asking: OrderedDict[str, float] = OrderedDict()
        self.progress_at: dict[str, float] = {}  # a holder's last accepted group, or the grant that made it one
        self._lost: list[int] = []
        self._calls: dict[int, _Call] = {}  # slot -> its grant's call, until the slot settles
        self._rates: dict[str, CallWindow] = {}  # by sampler: the calls measured here
        self._announced: dict[int, float] = {}  # version -> when the trainer announced it
        self._syncs: dict[str, list[float]] = {}  # by sampler: its last SYNC_SAMPLES sync times
        self._paces: dict[str, deque[_Call]] = {}  # by sampler: its last calls delivered
        self._lengths: deque[int] = deque(maxlen=LONG_SAMPLES)  # the longest completion of each group delivered
        self._long_tokens: int | None = None  # their LONG_QUANTILE, sorted out once a delivery, not once an ask
        # A long group's tokens until LONG_SAMPLES groups came (0: their quantile from the first):
        # the first to come are the short ones, and the long ones of the joining arrived stale.
        self.max_tokens = max_tokens
        self._running: dict[str, int] = {}  # by sampler: the newest version it asked with
        self._claims: dict[str, float] = {}  # by sampler: the seconds a token it claims (GrantRequest)
        self._claims_median: float | None = None  # their median, sorted out once a claim changes, not once an ask
        # Released for holding slots unfilled, and no group accepted since: one slot at a time,
        # so a hoarder asking 50 times a second cannot take the released work again at once.
        self.probation: set[str] = set()
        # ... and until when it gets none while another sampler asks (release_unfilled's bench).
        self.benched: dict[str, float] = {}
        self.bound = bound or DeliveryBound()
        self.deliveries: dict[str, Deliveries] = {}  # by sampler
        self._withholders: list[str] = []  # past the bound since take_withholders

    def resume(self, issued: int, window: int) -> None:
        """A restarted trainer: it numbers on from `issued`, and groups on its predecessors' last
        `window` slots may still come (generated before the restart, unread)."""
        self.issued = issued
        self.earlier = range(max(0, issued - window) + 1, issued + 1)

    def earlier_prompt(self, slot: int, prompt: int) -> int | None:
        """`prompt`, if it is the one a predecessor's grant of `slot` named and this is the first
        group for it; else None. Only its fresh draws can be known (`slot_prompt`: a lost slot's
        owed prompt it granted cannot): a group on one of those is refused, with no strike."""
        if slot not in self.earlier or slot in self._earlier_taken or prompt != slot_prompt(self.seed, slot):
            return None
        self._earlier_taken.add(slot)
        return prompt

    def held(self, sampler_id: str) -> int:
        return len(self._holding.get(sampler_id, ()))

    def holders(self) -> set[str]:
        return {sampler_id for sampler_id, slots in self._holding.items() if slots}

    def share(self, window: int, now: float) -> int:
        """The most one sampler may hold: an equal part of `window` among those asking (a benched
        one takes no part)."""
        return math.ceil(window / max(1, self.sharing(now)))

    def sharing(self, now: float) -> int:
        """How many samplers the work is shared among: those that asked lately (within active_s
        of `now`, which only moves on), but the benched."""
        while self._asking and now - next(iter(self._asking.values())) > self.active_s:
            self._asking.popitem(last=False)
        return len(self._asking) - sum(1 for s, until in self.benched.items() if now < until and s in self._asking)

    def _on_bench(self, sampler_id: str, now: float) -> bool:
        return now < self.benched.get(sampler_id, 0.0)

    def announced(self, version: int, now: float) -> None:
        """The trainer announced `version` (samplers begin to fetch it now)."""
        self._announced.setdefault(version, now)
        for old in [v for v in self._announced if v < version - SYNC_SAMPLES]:
            del self._announced[old]

    def claimed(self, sampler_id: str, s_per_token: float) -> None:
        """The seconds a token `sampler_id` claims it takes (its warm-up's)."""
        if self._claims.get(sampler_id) != s_per_token:
            self._claims[sampler_id] = s_per_token
            self._claims_median = None

    def in_the_faster_half(self, s_per_token: float) -> bool | None:
        """Whether a sampler claiming `s_per_token` is among the faster half of the fleet's
        claims (None: fewer than JOINING_CLAIMS_MIN to judge by)."""
        if len(self._claims) < JOINING_CLAIMS_MIN:
            return None
        if self._claims_median is None:
            self._claims_median = statistics.median(self._claims.values())
        return s_per_token <= self._claims_median

    def step_s(self) -> float | None:
        """A step's time as the deadlines judge it: STEP_SHARE of the lower quartile of the
        intervals between the trainer's recent announcements (None before it has three: the first
        interval holds the fleet's joining, and alone it let through groups that arrived stale).
        Not their mean: the first step, waiting for the fleet, took four of the later ones."""
        if len(self._announced) < 3:
            return None
        announced = sorted(self._announced.items())
        intervals = sorted((at - before_at) / (v - before)
                           for (before, before_at), (v, at) in zip(announced, announced[1:]))
        return STEP_SHARE * intervals[len(intervals) // 4]

    def fresh_for_s(self, version: int, max_staleness: int, now: float) -> float | None:
        """How long from `now` a group generated with `version` may take and still arrive fresh:
        until the trainer announces version + max_staleness + 1, a step_s each (None: not known
        yet). At least the steps still to come after the one under way: a step running long
        moves the deadline too (without that floor every sampler was refused, one grant a
        REDRAW_S, and a step took 90 s)."""
        if (interval := self.step_s()) is None:
            return None
        last, last_at = max(self._announced.items())
        ahead = version + max_staleness + 1 - last  # announcements until its groups are stale
        return max(last_at + ahead * interval - now, (ahead - 1) * interval)

    def long_group_s(self, sampler_id: str, now: float, claimed_s_per_token: float | None = None) -> float | None:
        """How long `sampler_id` would take from a grant to the arrival of a long group (PACE_*,
        LONG_*), at its measured pace, else at the pace it claims; None: it delivered none lately
        and claims none, or no group has arrived yet to say what a long one is."""
        kept = [call for call in self._paces.get(sampler_id, ()) if now - call.last_at <= PACE_KEPT_S]
        if not kept and claimed_s_per_token is None or not self._lengths:
            return None
        if self._long_tokens is None:
            lengths = sorted(self._lengths)
            self._long_tokens = lengths[math.ceil(LONG_QUANTILE * len(lengths)) - 1]
            if len(lengths) < LONG_SAMPLES:
                self._long_tokens = max(self._long_tokens, self.max_tokens)
        if not kept:
            return claimed_s_per_token * self._long_tokens
        seconds = sum(call.last_at - call.granted_at for call in kept)
        return seconds / max(1, sum(call.longest for call in kept)) * self._long_tokens

    def synced(self, sampler_id: str) -> float | None:
        """The sync time the trainer observed of `sampler_id`, or None before the first."""
        samples = self._syncs.get(sampler_id)
        return min(samples) if samples else None

    def grant(self, sampler_id: str, want: int, headroom: int, window: int, now: float,
              version: int | None = None) -> tuple[list[int], bool]:
        """Grant `sampler_id`, which runs `version`, up to `want` slots of the `headroom` left,
        within its share. Returns (the slots' numbers, whether headroom is left after them that
        it may take: not while it holds its share, which it holds until its groups are read,
        often the next step; one at its share told "ask again soon" asked every few seconds)."""
        self.asked_at[sampler_id] = now
        self._asking.pop(sampler_id, None)
        self._asking[sampler_id] = now
        if version is not None:
            self._observe_sync(sampler_id, version, now)
        if self._on_bench(sampler_id, now) and self.sharing(now):  # others ask: the work is theirs
            return [], False
        held = self.held(sampler_id)
        # Scarce headroom is split too: a sampler that always asks first must not take it all.
        headroom_share = self.share(headroom, now) if headroom > 0 else 0
        share = 1 if sampler_id in self.probation else self.share(window, now)
        groups = max(0, min(want, headroom_share, share - held))
        slots = list(range(self.issued + 1, self.issued + 1 + groups))
        self.issued += groups
        for slot in slots:
            if self.owed:
                self.prompts[slot], self.noise[slot] = self.owed.popleft()
            else:
                self.prompts[slot] = slot_prompt(self.seed, slot)
        self.outstanding.update((slot, sampler_id) for slot in slots)
        self._holding.setdefault(sampler_id, set()).update(slots)
        call = _Call(sampler_id, now, len(slots), version=version)
        self._calls.update((slot, call) for slot in slots)
        if slots and not held:
            self.progress_at[sampler_id] = now
        if slots:
            self.granted_at = now
        return slots, headroom > groups and held + groups < share

    def _observe_sync(self, sampler_id: str, version: int, now: float) -> None:
        # Only a move to a newer version by a sampler already running: one that joins late did
        # not wait for the announcement.
        running = self._running.get(sampler_id)
        if running is not None and version > running and version in self._announced:
            samples = self._syncs.setdefault(sampler_id, [])
            samples.append(now - self._announced[version])
            del samples[:-SYNC_SAMPLES]
        if running is None or version > running:
            self._running[sampler_id] = version

    def delivered(self, sampler_id: str, slot: int, arrived: float, tokens: int = 1) -> int | None:
        """A group naming `slot` arrived from `sampler_id` (stored by the broker at `arrived`, not
        when the trainer, busy with a step, got to it; `tokens` in its longest completion): the
        prompt index the slot was granted with, if it was one of its slots (which it ends), else
        None. Its earlier slots still out were passed over: they end undelivered (their groups,
        should they still come, hold no slot)."""
        if self.outstanding.get(slot) != sampler_id:
            return None
        passed = sorted(s for s in self._holding[sampler_id] if s < slot)
        self.revoke(passed)
        self._count(sampler_id, delivered=1, undelivered=len(passed))
        self._end(slot)
        call = self._calls[slot]
        call.last_at = max(call.last_at, arrived, call.granted_at)  # clocks apart by a little
        if not call.longest:  # its first group delivered
            self._paces.setdefault(sampler_id, deque(maxlen=PACE_SAMPLES)).append(call)
        call.longest = max(call.longest, tokens, 1)
        self._lengths.append(tokens)
        self._long_tokens = None
        return self.prompts[slot]

    def asked_with(self, slot: int) -> int | None:
        """The version the holder of `slot` (out, or delivered and not yet settled) said it ran
        when it was granted; None where it said none."""
        call = self._calls.get(slot)
        return None if call is None else call.version

    def accepted(self, slot: int) -> None:
        """A delivered slot's group is to be trained: its holder made progress (a group the
        trainer refuses is none, or junk naming a held slot would keep the stall clock still)."""
        call = self._calls[slot]
        self.progress_at[call.sampler_id] = max(self.progress_at.get(call.sampler_id, 0.0), call.last_at)
        self.probation.discard(call.sampler_id)
        self.benched.pop(call.sampler_id, None)
        self._settle(slot, accepted=True)

    def wasted(self, slot: int) -> None:
        """A delivered slot's group was not trained (stale or rejected)."""
        self._settle(slot, accepted=False)
        self._lost.append(slot)

    def set_aside(self, slot: int) -> None:
        """A delivered slot's group was accepted and not trained (dynamic sampling: its rewards
        were all equal): its holder made progress, the step needs another group in its place
        (handed out as a lost slot's), and its prompt is not owed (it taught nothing)."""
        self._lost.append(slot)

    def owe(self, prompt: int, noise_slot: int) -> None:
        """A trained group found forged after its slot settled (in its step): its prompt is owed,
        with the noise it was granted with."""
        self.owed.append((prompt, noise_slot))

    def noise_slot(self, slot: int) -> int:
        """The slot whose keyed noise the group on `slot` (out, or delivered and not yet settled)
        draws with: its own, or that of the slot its prompt was first granted on."""
        return self.noise.get(slot, slot)

    def release(self, sampler_id: str) -> list[int]:
        """End every slot `sampler_id` holds (it stopped, restarted, died or stalled): they are lost,
        and undelivered."""
        slots = sorted(self._holding.get(sampler_id, ()))
        self.revoke(slots)
        self._count(sampler_id, delivered=0, undelivered=len(slots))
        return slots

    def release_unfilled(self, sampler_id: str, now: float, bench_s: float) -> tuple[list[int], bool]:
        """End the slots of a holder alive but stalled (stall_limits_s): they are lost, it is on
        the bench for `bench_s` (no slot while another sampler asks: a hoarder cost a sequential
        step a release interval each time it took the work again), then on probation. Returns
        them, and whether it was on probation already (a repeat: a strike; an honest sampler
        slowed once delivers, and its probation ends)."""
        repeat = sampler_id in self.probation
        self.probation.add(sampler_id)
        self.benched[sampler_id] = now + bench_s
        return self.release(sampler_id), repeat

    def stall_limits_s(self, holders: Iterable[str], now: float, at_least: float, at_most: float) -> dict[str, float]:
        """How long each of `holders` may hold slots without a group accepted: STALL_CALLS times
        its calls' measured time (the fleet's median for one never measured: a hoarder never is),
        within [at_least, at_most]; `at_most` alone while no sampler's call was measured. The
        fleet's median is worked out once, not once a holder: at 1,000 samplers each holder's
        limit scanned every sampler's calls, up to a second of the trainer's CPU each wait."""
        limits, fleet_s = {}, None
        for sampler_id in holders:
            window = self._rates.get(sampler_id)
            if window is None:
                if fleet_s is None:
                    calls = sorted(c for c in (w.rates(now).call_s for w in self._rates.values()) if c > 0)
                    fleet_s = calls[len(calls) // 2] if calls else 0.0
                call_s = fleet_s
            else:
                call_s = window.rates(now).call_s
            limits[sampler_id] = at_most if call_s <= 0 else min(at_most, max(at_least, STALL_CALLS * call_s))
        return limits

    def revoke(self, slots: list[int]) -> None:
        """End `slots`: they are lost (and, where the grant could not be recorded, never handed
        over: no sampler's doing)."""
        for slot in slots:
            self._end(slot)
            self._settle(slot, accepted=False)
        self._lost += slots

    def _end(self, slot: int) -> None:
        """`slot` is out no longer."""
        self._holding[self.outstanding.pop(slot)].discard(slot)

    def _count(self, sampler_id: str, delivered: int, undelivered: int) -> None:
        record = self.deliveries.setdefault(sampler_id, Deliveries(recent=deque(maxlen=self.bound.window)))
        record.ended += delivered + undelivered
        record.undelivered += undelivered
        record.recent.extend([False] * delivered + [True] * undelivered)
        if undelivered and sum(record.recent) > self.bound.most:
            record.recent.clear()  # struck for these: the next strike takes as many again
            self._withholders.append(sampler_id)

    def take_withholders(self) -> list[str]:
        """The samplers that went past the bound since the last call, once per time."""
        withholders, self._withholders = self._withholders, []
        return withholders

    def _settle(self, slot: int, accepted: bool) -> None:
        prompt, noise_slot = self.prompts.pop(slot), self.noise.pop(slot, slot)
        if not accepted:
            self.owed.append((prompt, noise_slot))
        call = self._calls.pop(slot)
        call.open -= 1
        call.accepted += accepted
        if call.open == 0 and call.accepted:
            window = self._rates.setdefault(call.sampler_id, CallWindow(self.rate_window_s))
            window.add(call.last_at, call.last_at - call.granted_at, call.accepted, 0)

    def measured(self, sampler_id: str, now: float) -> Rates:
        """The sampler's rates over its calls the trainer measured (zero before the first)."""
        window = self._rates.get(sampler_id)
        return window.rates(now) if window else Rates(0.0, 0.0, 0.0)

    def take_lost(self) -> list[int]:
        """The slots lost since the last call."""
        lost, self._lost = self._lost, []
        return lost


class Heartbeats:
    """When each sampler's heartbeat last changed, by this process's own clock (a remote clock
    may be skewed): a sampler whose heartbeat stops changing is dead. Which said they were
    stopping (their entry expires soon after, so it is remembered here), and which process runs
    under each id: one restarted under its id (systemd, compose, Kubernetes) knows nothing of
    the slots its predecessor held."""

    def __init__(self):
        self.seen: dict[str, tuple[int, float]] = {}  # sampler -> (heartbeat revision, when it changed)
        self.changes: dict[str, int] = {}  # sampler -> changes seen after the first reading
        self.stopped: set[str] = set()  # its process said `draining`, until its slots are released
        self.processes: dict[str, tuple[str, str]] = {}  # sampler -> (its process now, the one before)

    def observe(self, sampler_id: str, revision: int, now: float, process: str = "",
                stopping: bool = False) -> bool:
        """A reading of its heartbeat (`revision` 0: no key, none yet or expired: not a sign of
        life). Returns whether it is a new process under a known id (restarted)."""
        last = self.seen.get(sampler_id)
        if last is None or (revision and last[0] != revision):
            if last is not None:
                self.changes[sampler_id] = self.changes.get(sampler_id, 0) + 1
            self.seen[sampler_id] = (revision, now)
        restarted = self.restarted(sampler_id, process)
        if stopping and process == self.processes.get(sampler_id, ("", ""))[0]:
            self.stopped.add(sampler_id)
        return restarted

    def heard(self, sampler_id: str, now: float) -> None:
        """It asked for work: as much a sign of life as its heartbeat's change. Its heartbeat is
        read only while it holds slots: judged by the reading of its last holding, one granted
        work again after a while idle was found silent for minutes and its slots released (at
        1,000 samplers, 359 in a 16-step run, and a sixth of the tokens thrown away). Alive, it is
        held to the stall rule: one asking to seem alive, and never delivering, is released as
        stalled and struck, not kept for `trainer.reissue_after_s`."""
        if sampler_id in self.seen:  # else not yet read: not silent (silent_for)
            self.seen[sampler_id] = (self.seen[sampler_id][0], now)
            self.changes[sampler_id] = self.changes.get(sampler_id, 0) + 1

    def restarted(self, sampler_id: str, process: str) -> bool:
        """Whether `process` (from a heartbeat or a request for work) is a new process under
        a known id. The predecessor's last heartbeat, read after its successor asked for work,
        is not taken for a third; "" (a sampler before schema 15) is never a restart."""
        now, before = self.processes.get(sampler_id, ("", ""))
        if not process or process in (now, before):
            return False
        self.processes[sampler_id] = (process, now)
        if now:
            self.stopped.discard(sampler_id)  # its predecessor stopped, not it
        return bool(now)

    def beating(self, sampler_id: str) -> bool:
        """Whether it gave a sign of life while this process watched (its heartbeat changed, or it
        asked for work): alive, not merely not yet found silent (one that died before a second
        reading is found silent, never stuck)."""
        return self.changes.get(sampler_id, 0) > 0

    def silent_for(self, sampler_id: str, now: float) -> float:
        """How long its heartbeat has not changed while this process watched: 0 before its first
        reading (granted slots while the holders' heartbeats were being read)."""
        return now - self.seen[sampler_id][1] if sampler_id in self.seen else 0.0
