"""The grant budget: its arithmetic, the fair share of the grant ledger, and the trainer
granting work to samplers that race for it on a real server."""

import asyncio
import itertools
import signal
import time

import pytest

from echo.engines.hf import HFEngine
from echo.fleet.grants import (
    ASK_AGAIN_MIN_S,
    ASKS_PER_S,
    IDLE_ASK_MIN_S,
    IDLE_ASKS_PER_S,
    JOINING_CLAIMS_MIN,
    LONG_SAMPLES,
    PACE_KEPT_S,
    REDRAW_S,
    STEP_SHARE,
    DeliveryBound,
    GrantLedger,
    Heartbeats,
    allowance,
    ask_again_s,
    ask_share,
    drawn_to_ask,
    lost_slots,
    sampler_cap,
)
from echo.fleet.throughput import CallWindow
from echo.tasks import load_task
from echo.train.checkpoint import TrainerState
from echo.wire.codec import decode, encode
from echo.wire.messages import Grant, GrantBudget, GrantRequest, SamplerStatus
from echo.wire.names import BUDGET_KEY, GRANT_TIMEOUT_S, SCHEMA_VERSION, SLOTS_KEY_BEFORE_14
from streams.grants import record_slots_granted, request_grant, serve_grants, slots_granted
from streams.lease import take_lease
from streams.registry import put_status
from streams.watch import read_value
from streams.weights import WeightsPublisher
from tests.conftest import TINY_BASE, adapter_for_version, eventually_async, tiny_config
from workers.sampler.sampler import Sampler
from workers.sampler.work import IDLE_WAIT_MAX_S, Work, idle_s
from workers.trainer.coordinator import delivered_paces
from workers.trainer.granter import AsyncGranter, SequentialGranter
from workers.trainer.strikes import Quarantined


def test_allowance_covers_the_staleness_window_plus_lost_groups():
    assert allowance(version=0, max_staleness=0, groups_per_step=4, lost=0) == 4  # on-policy: one step
    assert allowance(version=3, max_staleness=1, groups_per_step=4, lost=2) == 22


def test_a_sampler_behind_the_trainer_gets_a_smaller_cap():
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=5, groups_per_step=4) == 28
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=3, groups_per_step=4) == 20


class _Budget:
    """Async mode's granter without its broker: samplers take all the headroom they are given,
    groups arrive, steps end, and what is in flight is counted after each."""

    def __init__(self, tmp_path, groups_per_step: int = 4, max_staleness: int = 1):
        cfg = tiny_config(tmp_path, trainer={"groups_per_step": groups_per_step, "max_staleness": max_staleness})
        # active_s 0: the sampler asking is the only one sharing the window
        self.granter = AsyncGranter(None, 0, cfg, TrainerState(), GrantLedger(active_s=0.0))
        self.window = (max_staleness + 1) * groups_per_step
        self.accepted = 0

    def take(self, sampler: str) -> list[int]:
        request = GrantRequest(want=1000, term=1, version=self.granter.version)
        return self.granter.grant_work(sampler, request)[0]

    def arrive(self, sampler: str, slot: int, trained: bool = True) -> None:
        """A group naming `slot` from `sampler`, as the intake settles it (workers/trainer/intake.py)."""
        ledger = self.granter.ledger
        if ledger.delivered(sampler, slot, arrived=0.0):
            (ledger.accepted if trained else ledger.wasted)(slot)
        self.accepted += trained

    def release(self, sampler: str) -> None:
        """Its heartbeat stopped while the trainer waited: its slots are handed out again."""
        self.granter.ledger.release(sampler)
        self.granter.reissue_lost(self.granter.ledger.take_lost(), accepted=self.accepted)

    def step(self) -> None:
        """The step trained its groups; the next one asks (Granter.ask without its publish)."""
        assert self.accepted == self.granter.cfg.trainer.groups_per_step
        self.granter.version, self.accepted = self.granter.version + 1, 0
        self.granter.reissue_lost(self.granter.ledger.take_lost(), accepted=0)

    def in_flight(self) -> int:
        ledger = self.granter.ledger
        return len(ledger.outstanding) + self.granter.highest_slot() - ledger.issued


def test_the_groups_in_flight_come_back_to_the_window_whatever_arrives(tmp_path):
    """A relay down 20 s had its samplers' slots released and handed out again; their groups
    then came after all, fresh, and were trained. From then on one group too many was in flight
    for the rest of the run (93-97 stale drops in 120 steps, 16% of tokens wasted); so did one
    forged but valid group. Lost is now counted from what is out, every step."""
    budget = _Budget(tmp_path)
    late = budget.take("relayed")
    assert len(late) == budget.in_flight() == 8
    budget.release("relayed")  # the outage
    assert len(budget.take("direct")) == 8  # handed out again
    for slot in late[:4]:  # the outage ends: its groups arrive, fresh, and are trained
        budget.arrive("relayed", slot)
    budget.step()
    assert budget.in_flight() == 8
    for slot in late[4:]:
        budget.arrive("relayed", slot)
    budget.step()
    assert budget.in_flight() == 8

    held = sorted(budget.granter.ledger.outstanding)
    budget.arrive("direct", held[0])
    budget.arrive("direct", held[0])  # delivered twice: the second copy held no slot, and is trained
    budget.arrive("forger", 10**6)  # a group that held no slot, trained
    budget.arrive("direct", held[1], trained=False)  # stale: its slot is lost
    budget.arrive("direct", held[2])
    budget.step()
    assert budget.in_flight() == 8
    budget.take("direct")
    assert budget.in_flight() == 8 and budget.granter.highest_slot() == budget.granter.ledger.issued

    budget.arrive("direct", held[3])
    budget.arrive("direct", held[4])  # the step being collected has 2 of its 4
    budget.release("direct")
    assert budget.in_flight() == 8 - 2


def test_lost_slots_are_what_was_issued_and_is_neither_out_nor_trained():
    assert lost_slots(issued=20, outstanding=5, version=3, groups_per_step=4, accepted=1) == 2
    assert lost_slots(issued=12, outstanding=1, version=3, groups_per_step=4, accepted=0) == -1  # one trained held none


def test_each_sampler_asking_holds_at_most_an_equal_share_of_the_window():
    ledger = GrantLedger(issued=10, active_s=10)  # a restarted trainer numbers on from 10
    # At its share, a sampler is told none is left for it (not "ask again soon"): it holds the
    # share until its groups are read, often the next step.
    assert ledger.grant("a", want=8, headroom=100, window=8, now=0) == (list(range(11, 19)), False)  # alone: all
    assert ledger.grant("b", want=8, headroom=92, window=8, now=1) == ([19, 20, 21, 22], False)  # two ask: 4 each
    assert ledger.grant("a", want=8, headroom=88, window=8, now=2) == ([], False)  # a holds 8 already
    for slot in range(11, 17):
        assert ledger.delivered("a", slot, arrived=3)
    assert ledger.grant("a", want=1, headroom=88, window=8, now=3) == ([23], True)  # its share is 4
    assert ledger.grant("a", want=8, headroom=87, window=8, now=3) == ([24], False)
    assert ledger.grant("c", want=8, headroom=3, window=8, now=4) == ([25], True)  # scarce headroom: a third of it
    # a and b stop asking (dead, or a hoarder gone quiet): after active_s the window is c's again.
    assert len(ledger.grant("c", want=8, headroom=50, window=8, now=30)[0]) == 7
    assert ledger.held("a") == 4 and ledger.holders() == {"a", "b", "c"} and ledger.issued == 32


def test_slots_end_by_number_and_only_lost_ones_are_reported():
    ledger = GrantLedger()
    slots, _ = ledger.grant("a", want=3, headroom=10, window=10, now=0)
    ledger.grant("b", want=2, headroom=7, window=10, now=0)  # 4, 5
    assert not ledger.delivered("b", slots[0], arrived=1)  # another's slot: ends nothing
    assert not ledger.delivered("a", 99, arrived=1)  # junk, or a previous trainer's grant
    assert ledger.delivered("a", slots[0], arrived=1) and not ledger.delivered("a", slots[0], arrived=2)  # once
    ledger.wasted(slots[0])  # it arrived stale
    assert ledger.take_lost() == [1] and ledger.take_lost() == []
    assert ledger.release("b") == [4, 5] and ledger.holders() == {"a"}  # b died holding two
    assert ledger.take_lost() == [4, 5]
    # Only a group the trainer accepts is progress: junk naming a held slot must not keep the
    # stall clock still (an attack sent a junk group a minute, and the clock never fired).
    assert ledger.progress_at == {"a": 0, "b": 0}
    assert ledger.delivered("a", slots[1], arrived=3)
    ledger.accepted(slots[1])
    assert ledger.progress_at == {"a": 3, "b": 0}


def test_slots_passed_over_or_held_at_a_release_are_undelivered_and_past_the_bound_a_strike():
    """Selective delivery: an honest sampler delivers its slots in the order granted; one keeping back the
    groups it dislikes passes over its own slots. Each passed over ends undelivered at once (lost,
    its prompt owed), as do the slots held at a release; past the bound in its last `window`
    ended slots the sampler is named once, and counted afresh. Slots the trainer could not hand
    over (revoke) are not the sampler's doing."""
    ledger = GrantLedger(bound=DeliveryBound(window=8, share=0.25))  # more than 2 of the last 8
    for slot in ledger.grant("honest", want=4, headroom=64, window=64, now=0)[0]:  # 1-4
        assert ledger.delivered("honest", slot, arrived=1) is not None
        ledger.accepted(slot)
    ledger.grant("w", want=4, headroom=64, window=64, now=0)  # 5-8
    prompts = dict(ledger.prompts)
    assert ledger.delivered("w", 6, arrived=1) is not None  # 5 passed over
    assert 5 not in ledger.outstanding and ledger.take_lost() == [5] and list(ledger.owed) == [(prompts[5], 5)]
    assert ledger.delivered("w", 5, arrived=2) is None  # should it come after all, it holds no slot
    assert ledger.delivered("w", 8, arrived=2) is not None  # 7 too
    assert (ledger.deliveries["w"].ended, ledger.deliveries["w"].undelivered) == (4, 2)
    assert ledger.take_withholders() == []  # 2 of 8: within the bound
    ledger.revoke(ledger.grant("w", want=2, headroom=64, window=64, now=0)[0])  # never handed over
    assert ledger.deliveries["w"].undelivered == 2
    ledger.grant("w", want=1, headroom=64, window=64, now=0)
    assert ledger.release("w") and ledger.take_withholders() == ["w"]  # it stopped holding one: 3 of 5
    assert ledger.take_withholders() == []
    ledger.grant("w", want=1, headroom=64, window=64, now=0)
    ledger.release("w")
    assert ledger.take_withholders() == []  # counted afresh since its strike
    assert (ledger.deliveries["w"].ended, ledger.deliveries["w"].undelivered) == (6, 4)
    assert (ledger.deliveries["honest"].ended, ledger.deliveries["honest"].undelivered) == (4, 0)


def test_the_stall_limits_of_a_wait_read_each_samplers_calls_once_however_many_holders_are_new(monkeypatch):
    """Stall limits at scale: each holder's limit scanned every sampler's calls (for the fleet's median, which
    a holder never measured is held to): at 1,000 samplers a wait (about one a second) cost the
    trainer up to a second of CPU while the fleet joined. The fleet's calls are read once a wait."""
    ledger = GrantLedger()
    for i in range(1000):
        for slot in ledger.grant(f"s{i}", want=1, headroom=10**6, window=10**6, now=0)[0]:
            ledger.delivered(f"s{i}", slot, arrived=5)
            ledger.accepted(slot)  # a 5-s call each
    reads = []
    rates = CallWindow.rates
    monkeypatch.setattr(CallWindow, "rates", lambda window, now: reads.append(window) or rates(window, now))
    holders = [f"s{i}" for i in range(0, 1000, 4)] + [f"new{i}" for i in range(256)]
    limits = ledger.stall_limits_s(holders, now=6, at_least=1, at_most=300)
    assert limits == dict.fromkeys(holders, 20.0)  # four calls of its own, or of the fleet's median
    assert len(reads) == 1000 + 250  # the fleet's once, and each measured holder's own


def test_a_holder_that_fills_no_slot_for_a_few_calls_is_released_then_held_to_one_slot_until_it_delivers():
    ledger = GrantLedger()
    assert ledger.stall_limits_s(["x"], now=0, at_least=15, at_most=300)["x"] == 300  # no call measured yet
    for slot in ledger.grant("h", want=2, headroom=8, window=8, now=0)[0]:
        ledger.delivered("h", slot, arrived=5)
        ledger.accepted(slot)  # h's call: 5 s
    assert ledger.stall_limits_s(["h"], now=6, at_least=15, at_most=300)["h"] == 20  # four of its calls
    assert ledger.stall_limits_s(["x"], now=6, at_least=15, at_most=300)["x"] == 20  # never measured: the fleet's
    assert ledger.stall_limits_s(["x"], now=6, at_least=30, at_most=300)["x"] == 30
    assert ledger.stall_limits_s(["x"], now=6, at_least=1, at_most=10)["x"] == 10
    held, _ = ledger.grant("x", want=4, headroom=6, window=8, now=6)
    assert len(held) == 3 and ledger.release_unfilled("x", now=6, bench_s=20) == (held, False)
    assert ledger.take_lost() == held
    assert ledger.grant("x", want=4, headroom=8, window=8, now=10) == ([], False)  # benched while h asks
    assert len(ledger.grant("h", want=8, headroom=8, window=8, now=10)[0]) == 8  # x takes no share meanwhile
    assert len(ledger.grant("x", want=4, headroom=8, window=8, now=30)[0]) == 1  # off the bench: one slot at a time
    assert ledger.grant("x", want=4, headroom=8, window=8, now=31)[0] == []
    assert ledger.release_unfilled("x", now=31, bench_s=20)[1] is True  # again: a strike
    (slot,), _ = ledger.grant("x", want=4, headroom=8, window=8, now=60)
    assert ledger.delivered("x", slot, arrived=61)
    ledger.accepted(slot)
    assert "x" not in ledger.probation  # it delivers: a whole share again
    assert len(ledger.grant("x", want=4, headroom=8, window=8, now=62)[0]) == 4


async def _beat(run, sampler_id: str) -> None:
    """A live heartbeat, forever."""
    for beat in itertools.count():
        await put_status(run, SamplerStatus(sampler_id=sampler_id, version=0, groups_published=beat,
                                            weight_failures={}, updated_at=time.time()))
        await asyncio.sleep(0.1)


async def test_a_hoarder_is_released_within_a_few_calls_held_to_a_slot_and_struck_when_it_hoards_again(runs, tmp_path):
    """Hoarding: in sequential mode a sampler with a live heartbeat that asks for work 50 times a
    second and never delivers took 2 of 4 slots: no step for over 367 s, the slots released after
    `trainer.reissue_after_s` (300 s) and taken again by the same sampler 0.8 s later. Its slots
    are now released by the stall rule (docs/design.md), within a few of the fleet's measured
    calls; it then holds one slot at a time, and hoarding again is a strike."""
    cfg = tiny_config(tmp_path, run={"mode": "sequential"}, trainer={"groups_per_step": 4, "sampler_dead_after_s": 1.0,
                                                                     "reissue_after_s": 6.0}, sampler={"heartbeat_s": 0.1})
    run = await runs.open("hoard", "trainer")
    sampler = await runs.open("hoard", "sampler", create=False)
    lease = await take_lease(run)
    quarantine = Quarantined(run, after=0)
    granter = SequentialGranter(run, lease.term, cfg, TrainerState(), GrantLedger(), quarantine)
    await granter.start()
    await granter.ask(0)
    request = granter.request.request_id
    beating = asyncio.create_task(_beat(sampler, "x"))
    try:
        assert (await _ask(sampler, "x", lease.term, 0, 2, request)).groups == 2  # the hoarder asks first
        for slot in (await _ask(sampler, "h", lease.term, 0, 2, request)).slots:
            assert granter.ledger.delivered("h", slot, arrived=time.monotonic())
            granter.ledger.accepted(slot)  # h's call, measured: far shorter than the 2 s floor
        async def on_probation():  # time passing: its heartbeat lives, its slots stay unfilled
            await granter.on_wait(2)
            return granter.ledger.probation

        await eventually_async(on_probation, 60, every=0.5)
        assert granter.ledger.held("x") == 0 and quarantine.strikes == {}  # once may be a slow machine
        # Before the bench, it took the released work again at once, a release interval lost each time.
        # Benched (trainer.reissue_after_s) while h asks: the work is h's, one interval lost in all.
        assert (await _ask(sampler, "x", lease.term, 0, 2, request)).groups == 0
        assert (await _ask(sampler, "h", lease.term, 0, 2, request)).groups == 2
        async def one_slot():  # off the bench: a slot at a time
            return (await _ask(sampler, "x", lease.term, 0, 2, request)).groups == 1

        async def struck():
            await granter.on_wait(1)
            return "x" in quarantine

        await eventually_async(one_slot, 30, every=0.5)
        await eventually_async(struck, 60, every=0.5)
        assert quarantine.strikes == {"x": 1} and (await _ask(sampler, "x", lease.term, 0, 2, request)).groups == 0
    finally:
        beating.cancel()
        await granter.subscription.unsubscribe()


def test_a_heartbeat_that_stops_changing_is_silent_by_this_clock():
    beats = Heartbeats()
    beats.observe("a", revision=7, now=100.0)
    beats.observe("a", revision=7, now=104.0)
    assert beats.silent_for("a", now=110.0) == 10.0
    assert not beats.beating("a")  # one reading: it may have died right after it
    beats.observe("a", revision=9, now=111.0)  # a new beat, whatever its own clock says
    assert beats.silent_for("a", now=112.0) == 1.0 and beats.beating("a")
    # Granted slots while the holders' heartbeats were being read (bench.load, 32 samplers: the
    # trainer died of a KeyError): not read yet, not silent.
    assert beats.silent_for("b", now=112.0) == 0.0


async def test_a_holder_that_said_it_was_stopping_is_released_after_its_entry_expired(runs, tmp_path):
    """A stopping sampler's last heartbeat (`draining`) expires `sampler.entry_ttl_s` after it is
    written. Before, the trainer read heartbeats only while waiting for groups: busy meanwhile
    (its scoring process starting, a long step), it found no entry, and with
    `sampler_dead_after_s` above the entry's life the slots stayed held (test_sampler_crash: no
    step in 180 s). The trainer now reads the holders' heartbeats while it runs, and remembers."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0, "sampler_dead_after_s": 3600.0},
                      sampler={"heartbeat_s": 0.2, "entry_ttl_s": 1})
    run, granter, asked = await _granter_at_version_0(runs, "stopping", cfg)
    sampler = await runs.open("stopping", "sampler", create=False)
    assert (await granter.grant("x", asked)).groups == 2
    watching = asyncio.create_task(granter.holders.watch_heartbeats())
    try:
        await put_status(sampler, SamplerStatus(sampler_id="x", version=0, groups_published=0, weight_failures={},
                                                updated_at=time.time(), state="draining"))
        await eventually_async(lambda: "x" in granter.holders.heartbeats.stopped, 60)
        await sampler.registry.delete("x")  # expired, as the trainer's step went on
        await granter.on_wait(4)
        assert granter.ledger.holders() == set() and granter.holders.heartbeats.stopped == set()
    finally:
        watching.cancel()


def test_a_process_restarted_under_its_id_is_told_from_its_predecessor():
    beats = Heartbeats()
    assert not beats.observe("a", revision=1, now=0.0, process="aa")  # the first process seen
    assert not beats.restarted("a", "aa")
    assert beats.restarted("a", "bb")  # a new process asks for work
    assert not beats.observe("a", revision=2, now=1.0, process="aa", stopping=True)  # aa's last word, read late
    assert beats.stopped == set() and not beats.restarted("a", "")  # "": before schema 15, never a restart
    beats.observe("a", revision=3, now=2.0, process="bb", stopping=True)
    assert beats.stopped == {"a"}
    assert beats.observe("a", revision=4, now=3.0, process="cc")  # restarted again: cc has not stopped
    assert beats.stopped == set()


async def test_a_restarted_process_asking_for_work_hands_its_predecessors_slots_back_to_the_window(runs, tmp_path):
    """At S >= 1 a predecessor's slots, kept, shrank the window until `reissue_after_s`; the
    new process's first request for work now releases them, and it is granted afresh."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})
    run, granter, asked = await _granter_at_version_0(runs, "restarted", cfg)
    before = asked.model_copy(update={"want": 8, "process": "aa"})
    assert (await granter.grant("x", before)).groups == 8  # the whole window
    assert (await granter.grant("y", asked)).groups == 0
    after = before.model_copy(update={"process": "bb"})  # kill -9, and the restart policy's
    assert (await granter.grant("x", after)).groups == 0  # released, not yet handed out again
    assert granter.ledger.holders() == set()
    await granter.on_wait(4)  # the step waiting for groups: what was lost is handed out again
    assert (await granter.grant("x", after)).groups == 4 and (await granter.grant("y", asked)).groups == 2


# nothing now, ask again soon: as soon as the least wait (a few samplers ask)
ASK_AGAIN = {"schema_version": SCHEMA_VERSION, "slots": [], "prompts": [], "more": True, "noise_slots": [],
             "again_s": ASK_AGAIN_MIN_S, "wait_version": 0}


def test_a_crowd_told_to_ask_again_spreads_its_asks_and_the_ledger_counts_it_without_a_scan():
    """A crowd asking again: a thousand samplers told "work is left, not yours yet" each asked again 0.2 s
    later: 5,000 requests a second at the trainer. The wait now grows with the samplers asking,
    to ASKS_PER_S asks a second in all; and the ledger counts who asks, and what each holds,
    as they ask (the scans of every sampler and slot a grant made a step O(samplers^2))."""
    assert ask_again_s(8) == ASK_AGAIN_MIN_S and ask_again_s(1000) == 1000 / ASKS_PER_S == 5.0
    ledger = GrantLedger(active_s=30.0)
    for i in range(1000):
        ledger.grant(f"s{i}", 1, 0 if i % 2 else 1, 2000, now=i * 0.01)  # every other one gets a slot
    assert ledger.sharing(10.0) == 1000 and ledger.held("s0") == 1 and ledger.held("s1") == 0
    assert ledger.sharing(35.0) == 500  # those that asked more than 30 s before are no longer counted
    assert ledger.release("s0") == [1] and ledger.held("s0") == 0 and "s0" not in ledger.holders()


async def _granter_at_version_0(runs, run_id: str, cfg):
    """A trainer holding the run (opened through the `runs` fixture), its granter at version 0,
    and a request for 2 groups made with its weights: (run, granter, request)."""
    run = await runs.open(run_id, "trainer")
    lease = await take_lease(run)
    granter = AsyncGranter(run, lease.term, cfg, TrainerState(), GrantLedger())
    await granter.ask(0)
    return run, granter, GrantRequest(want=2, term=lease.term, version=0)


def _ask(run, sampler_id, term, version, want=2, pull_request_id=None):
    request = GrantRequest(want=want, term=term, version=version, pull_request_id=pull_request_id)
    return request_grant(run, sampler_id, request)


async def test_once_the_work_is_given_out_a_crowd_asking_costs_the_trainer_no_broker_request(runs, tmp_path):
    """A crowd asking for nothing: each budget wakes every idle sampler, and each ask read the asker's heartbeat
    from the broker (is it readable? none is granted work while it is not): at 1,000 samplers,
    1,000 reads a step, most of the trainer's CPU a token. The read is made only where there is
    work to grant; a sampler asking when none is left costs the trainer no request at all. And
    such samplers, waiting for the next budget, asked anyway every 5 s in case they had missed
    it: 200 requests a second at 1,000. They are told to wait longer as they are more, to
    IDLE_ASKS_PER_S in all."""
    assert ask_again_s(8, more=False) == IDLE_ASK_MIN_S and ask_again_s(1000, more=False) == 1000 / IDLE_ASKS_PER_S
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0})
    run, granter, asked = await _granter_at_version_0(runs, "crowd", cfg)
    assert sum([(await granter.grant(f"s{i}", asked)).groups for i in range(4)]) == 4  # the window, given out
    sent = run.nc.stats["out_msgs"]
    idle = [await granter.grant(f"idle{i}", asked) for i in range(1000)]
    assert run.nc.stats["out_msgs"] == sent  # (one with work to take is read: test_proven_rollouts.py)
    assert [(g.groups, g.more) for g in idle] == [(0, False)] * 1000
    assert idle[-1].again_s == 1004 / IDLE_ASKS_PER_S and idle_s(idle[-1]) == idle[-1].again_s
    assert idle_s(Grant(again_s=1e9)) == IDLE_WAIT_MAX_S and idle_s(None) == idle_s(Grant()) == IDLE_ASK_MIN_S


def test_a_budget_draws_about_two_idle_samplers_a_slot_open_and_each_draw_others():
    """A budget among 1,000 idle samplers with 128 slots open wakes about 256 of them; a draw of
    a budget with no count of the idle (a trainer before schema 26), or among few, wakes all."""
    ids = [f"s{i}" for i in range(1000)]
    share = ask_share(128, 1000)
    first = {s for s in ids if drawn_to_ask(s, 7, 0, share)}
    second = {s for s in ids if drawn_to_ask(s, 7, 1, share)}
    assert 200 < len(first) < 312 and 200 < len(second) < 312  # 256, binomially: within 3.6 sd
    assert len(first & second) < 100  # another draw, other samplers (65 expected)
    assert ask_share(128, 0) == ask_share(128, 100) == 1.0 and ask_share(0, 1000) == 0.0
    assert all(drawn_to_ask(s, 7, 0, 1.0) for s in ids) and not any(drawn_to_ask(s, 7, 0, 0.0) for s in ids)


async def _budget(run) -> GrantBudget:
    return (await read_value(run.state, BUDGET_KEY, lambda value: decode(GrantBudget, value)))[0]


async def test_a_budget_wakes_only_a_draw_of_the_idle_crowd_and_draws_again_while_its_slots_go_untaken(
        runs, tmp_path):
    """A crowd woken by a budget: each budget woke every idle sampler, and each asked: 1,000 requests a step for
    128 groups at 1,000 samplers, the largest cost of the trainer's that still grew with the
    samplers. A budget now says how many slots are open and how many samplers idle, and wakes
    about DRAWN_PER_OPEN_SLOT per slot. Where those drawn do not take them (busy, behind, gone),
    the trainer draws again after REDRAW_S, and not while the slots are taken."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 64, "max_staleness": 0})
    run, granter, asked = await _granter_at_version_0(runs, "drawn", cfg)
    asked = asked.model_copy(update={"want": 1})
    crowd = [Work(run, f"s{i}", 1, "p") for i in range(1000)]
    assert sum([(await granter.grant(w.sampler_id, asked)).groups for w in crowd]) == 64  # step 1's window
    for slot in list(granter.ledger.outstanding):  # step 1 trains them
        granter.ledger.delivered(granter.ledger.outstanding[slot], slot, arrived=time.monotonic())
        granter.ledger.accepted(slot)
    await granter.ask(1)
    budget = await _budget(run)
    assert (budget.open, budget.idle) == (64, 1000)
    for work in crowd:
        work.follow_budget(budget)
    drawn = [w for w in crowd if w.drawn == 1]
    assert 80 < len(drawn) < 180  # 128 expected: the rest sleep through this budget
    at_v1 = asked.model_copy(update={"version": 1})
    grants = [await granter.grant(w.sampler_id, at_v1) for w in drawn]
    assert sum(g.groups for g in grants) == 64  # every open slot taken, by a seventh of the crowd

    for slot in list(granter.ledger.outstanding):
        granter.ledger.delivered(granter.ledger.outstanding[slot], slot, arrived=time.monotonic())
        granter.ledger.accepted(slot)
    await granter.ask(2)
    first = await _budget(run)
    redraws = asyncio.ensure_future(granter.redraw_forever())
    try:
        async def redrawn():  # the drawn never ask: gone
            return (await _budget(run)).draw != first.draw

        await eventually_async(redrawn, 30 * REDRAW_S, why=lambda _: "no second draw while every slot stayed open")
        second = await _budget(run)
        assert second.open == 64 and second.version == 2
        for work in crowd:
            work.follow_budget(second)
        at_v2 = asked.model_copy(update={"version": 2})
        assert sum([(await granter.grant(w.sampler_id, at_v2)).groups for w in crowd if w.drawn == 2]) == 64
        taken = (await _budget(run)).draw
        await asyncio.sleep(3 * REDRAW_S)
        assert (await _budget(run)).draw == taken  # taken: no draw more
    finally:
        redraws.cancel()


async def test_waiting_for_groups_reads_the_holders_heartbeats_once_a_heartbeat_not_once_a_wait(runs, tmp_path):
    """Heartbeats read at scale: each wait for groups (a second apart) read every holder's heartbeat, 256 holders
    at 1,000 samplers: most of the trainer's broker requests. A reading younger than a heartbeat
    is used as it is, and a reading is one request, whatever the holders (a request each was most
    of the trainer's broker requests still, 2026-12-07)."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 20, "max_staleness": 0, "sampler_dead_after_s": 60.0},
                      sampler={"heartbeat_s": 30.0, "entry_ttl_s": 90})  # younger than a heartbeat however slow the box
    run, granter, asked = await _granter_at_version_0(runs, "waits", cfg)
    one = asked.model_copy(update={"want": 1})
    assert sum([(await granter.grant(f"s{i}", one)).groups for i in range(20)]) == 20  # 20 holders
    sent = run.nc.stats["out_msgs"]
    for _ in range(5):
        await granter.on_wait(20)
    assert run.nc.stats["out_msgs"] - sent == 1  # one reading, of the 20 holders
    granter.holders.heartbeats_read_at -= granter.holders.heartbeats_every_s  # a heartbeat later: read again
    await granter.on_wait(20)
    assert run.nc.stats["out_msgs"] - sent == 2


async def test_a_sampler_granted_work_after_a_while_idle_is_not_taken_for_dead_on_an_old_reading(runs, tmp_path):
    """Live samplers taken for dead, at 1,000 samplers: 359 samplers were judged gone in a 16-step run (silent for 4 to
    206 s by the trainer's readings), their slots released, and 265 of their groups then refused
    as on slots not held: a sixth of the tokens wasted. A sampler's heartbeat is read only while
    it holds slots, and a reading younger than a heartbeat is not read again: one granted work
    after a while idle was judged by the reading of its last holding, minutes old. Its asking for
    work is a sign of life too."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0, "sampler_dead_after_s": 5.0},
                      sampler={"heartbeat_s": 2.0})
    run, granter, asked = await _granter_at_version_0(runs, "idle", cfg)
    granter.holders.heartbeats.observe("s1", revision=7, now=time.monotonic() - 100)  # while it held slots, 100 s ago
    await granter.on_wait(4)  # a reading of the holders (none)
    assert (await granter.grant("s1", asked.model_copy(update={"want": 1}))).groups == 1
    await granter.on_wait(4)  # on that reading, where it is younger than a heartbeat: s1 unread since
    assert granter.ledger.holders() == {"s1"} and "s1" not in granter.holders.gone
    assert granter.holders.heartbeats.beating("s1")  # alive: held to the stall rule, as one whose heartbeat changed
    granter.holders.heartbeats_read_at -= granter.holders.heartbeats_every_s  # a heartbeat later: read, unchanged
    await granter.on_wait(4)
    assert granter.ledger.holders() == {"s1"}  # silent since its ask, not yet 5 s
    await asyncio.sleep(cfg.trainer.sampler_dead_after_s)
    granter.holders.heartbeats_read_at -= granter.holders.heartbeats_every_s
    await granter.on_wait(4)
    assert not granter.ledger.holders() and "s1" in granter.holders.gone  # silent since its ask: dead


async def test_a_run_begun_before_schema_14_numbers_its_slots_on_from_the_old_key(runs):
    run = await runs.open("renamed", "trainer")
    assert await slots_granted(run) == 0
    await run.state.put(SLOTS_KEY_BEFORE_14, b"8")  # what a schema-13 trainer recorded
    assert await slots_granted(run) == 8
    await record_slots_granted(run, 12)
    assert await slots_granted(run) == 12


async def test_grants_never_pass_the_cap_however_many_samplers_race(runs, tmp_path):
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})

    run = await runs.open("slots", "trainer")
    sampler = await runs.open("slots", "sampler", create=False)
    assert await _ask(sampler, "a", 1, 0) is None  # no trainer yet: no answer
    lease = await take_lease(run)
    await record_slots_granted(run, 8)  # the 8 groups of the 2 steps trained so far held slots 1-8
    granter = AsyncGranter(run, lease.term, cfg, TrainerState(version=2), GrantLedger())
    await granter.start()
    await granter.ask(2)  # slots up to (2 + 1 + 1) * 4 = 16
    assert (await _ask(sampler, "a", lease.term, 1, want=8)).groups == 4  # a version behind: cap 16 - 4
    assert (await _ask(sampler, "b", lease.term, 0, want=8)).groups == 0  # two behind: its groups would be stale
    grants = await asyncio.gather(*(_ask(sampler, f"s{i}", lease.term, 2) for i in range(12)))
    assert sum(g.groups for g in grants) == 4 and await slots_granted(run) == 16
    holder = next(f"s{i}" for i, g in enumerate(grants) if g.groups)
    assert (await _ask(sampler, holder, lease.term, 2)).groups == 0
    assert (await _ask(sampler, holder, lease.term, 3)).groups == 0  # a version the trainer has not published
    assert (await _ask(sampler, holder, lease.term - 1, 2)).groups == 0  # a previous trainer's weights
    for slot in sorted(granter.ledger.outstanding)[:4]:  # step 3 trains a's 4 groups
        assert granter.ledger.delivered("a", slot, arrived=time.monotonic())
        granter.ledger.accepted(slot)
    await granter.ask(3)
    # the holder has its share of the window (1 of 8 among 14 asking): none for it until it delivers
    assert (await _ask(sampler, holder, lease.term, 3, want=8)).model_dump() == ASK_AGAIN | {
        "more": False, "again_s": IDLE_ASK_MIN_S}
    assert (await _ask(sampler, "late", lease.term, 3, want=8)).groups == 1  # 15 asking: a share of 1 of 8

    # A restarted trainer numbers its grants on from the count in KV.
    again = AsyncGranter(run, lease.term, cfg, TrainerState(version=3), GrantLedger())
    await again.start()
    assert again.ledger.issued == 17 and again.state.lost == 17 - 3 * 4  # what was out is counted lost
    await granter.subscription.unsubscribe()
    await again.subscription.unsubscribe()


async def test_sequential_groups_are_granted_once_and_only_for_the_current_request(runs, tmp_path):
    cfg = tiny_config(tmp_path, run={"mode": "sequential"}, trainer={"groups_per_step": 6, "reissue_after_s": 0.1})

    run = await runs.open("seq", "trainer")
    sampler = await runs.open("seq", "sampler", create=False)
    lease = await take_lease(run)
    granter = SequentialGranter(run, lease.term, cfg, TrainerState(), GrantLedger())
    await granter.start()
    await granter.ask(0)
    request = granter.request
    grants = await asyncio.gather(*(_ask(sampler, f"s{i}", lease.term, 0, 4, request.request_id) for i in range(3)))
    assert sum(g.groups for g in grants) == 6  # in arrival order: the first alone may get its whole want
    assert (await _ask(sampler, "s0", lease.term, 0, 4, request.request_id)).model_dump() == {
        "schema_version": SCHEMA_VERSION, "slots": [], "prompts": [], "more": False, "noise_slots": [],
        "again_s": IDLE_ASK_MIN_S, "wait_version": 0}  # at the latest: the next request wakes it
    assert sorted(slot for g in grants for slot in g.slots) == list(range(1, 7))
    await asyncio.sleep(cfg.trainer.reissue_after_s + 0.05)  # the holders stall past it
    keeper = next(f"s{i}" for i, g in enumerate(grants) if g.slots)
    kept = grants[int(keeper[1:])].slots[0]
    granter.ledger.delivered(keeper, kept, time.monotonic())
    granter.ledger.accepted(kept)  # it makes progress
    released = 6 - granter.ledger.held(keeper) - 1
    await granter.on_wait(5)  # the others delivered nothing for reissue_after_s: only their slots are lost
    assert granter.ledger.holders() <= {keeper} and granter.granted == 6 - released
    assert granter.request.request_id == request.request_id  # the same request, published again
    asked_again = [await _ask(sampler, f"s{i}", lease.term, 0, 4, request.request_id) for i in range(3)]
    assert sum(g.groups for g in asked_again) == released
    assert min(slot for g in asked_again for slot in g.slots) == 7  # new numbers
    await granter.ask(1)  # the next step: the old request is over
    assert (await _ask(sampler, "s1", lease.term, 0, 4, request.request_id)).groups == 0
    await granter.subscription.unsubscribe()


async def test_no_work_is_granted_until_min_samplers_have_asked(runs, tmp_path):
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "min_samplers": 2})

    _, granter, asked = await _granter_at_version_0(runs, "fleet", cfg)
    assert (await granter.grant("early", asked)).model_dump() == ASK_AGAIN
    assert (await granter.grant("early", asked)).groups == 0  # asking again does not count twice
    assert (await granter.grant("late", asked)).groups == 2
    assert (await granter.grant("early", asked)).groups == 2


async def test_a_grant_the_broker_cannot_record_hands_over_nothing_and_is_handed_out_again(nats_server, runs, tmp_path):
    """The count of slots granted is in KV so that a restarted trainer numbers on; with the
    broker gone that write fails. Before, the slots stayed granted to a sampler that never got
    the answer, shrinking the window for good. Now they are lost (handed out again) and the
    sampler is told to ask again. A wait for groups meanwhile cannot read heartbeats: it
    carries on waiting. And the run still closes (nats-py flushes the requests it buffered
    meanwhile onto the lost connection, and raised)."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0})

    run, granter, asked = await _granter_at_version_0(runs, "unrecorded", cfg)
    assert (await granter.grant("a", asked)).groups == 2
    nats_server.process.send_signal(signal.SIGKILL)
    nats_server.process.wait()
    assert (await granter.grant("b", asked)).model_dump() == ASK_AGAIN
    # b's grant was slot 3 (half the headroom left, two samplers asking): lost, not held
    assert granter.ledger.holders() == {"a"} and granter.ledger.take_lost() == [3]
    await granter.on_wait(2)  # waiting for groups meanwhile: a's heartbeat is unread, and that is no failure
    assert granter.ledger.holders() == {"a"}
    await run.close()  # with the broker gone: it raises nothing (the fixture's close is then a no-op)


async def test_a_grant_that_fails_in_our_code_is_still_answered(runs):
    """Nothing granted, at once: a sampler is not left to wait out its request's timeout."""

    async def decide(sampler_id: str, request: GrantRequest):
        raise RuntimeError("a defect")

    run = await runs.open("failing", "trainer")
    await serve_grants(run, decide)
    reply = await run.nc.request(run.names.grants_subject("a"), encode(GrantRequest(want=1, term=1, version=0)),
                                 timeout=GRANT_TIMEOUT_S)
    assert decode(Grant, reply.data).groups == 0


def test_a_sampler_whose_long_groups_would_arrive_stale_gets_no_work_while_others_take_it(tmp_path):
    """Grants sized to pace: with speeds spread 10x, the slowest samplers' groups arrived stale, a tenth of
    the tokens generated wasted. The trainer measures each sampler's seconds a token (grant to
    arrival, over its calls' longest completions) and grants none to one whose long group (the
    fleet's 95th percentile) would arrive after the trainer moved past its version, while other
    samplers take the work. Never where none does (a fleet all slower than the trainer still
    gets it), nor with partial rollouts. One not measured yet is paced by the seconds a token its
    warm-up claims: in a joining crowd, the slowest quarter's first groups arrived stale."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})
    granter = AsyncGranter(None, 0, cfg, TrainerState(version=2), GrantLedger())
    ledger, t0 = granter.ledger, time.monotonic() - 21.0
    for version in range(3):  # a version every 10 s: version 2 at t0 + 20
        ledger.announced(version, t0 + 10.0 * version)

    def deliver(sampler_id: str, took: float, *longest: int) -> None:
        """One call of len(longest) groups, all arriving `took` after its grant."""
        slots, _ = ledger.grant(sampler_id, len(longest), 8, 64, now=t0, version=0)
        for slot, tokens in zip(slots, longest):
            assert ledger.delivered(sampler_id, slot, arrived=t0 + took, tokens=tokens) is not None
            ledger.accepted(slot)

    deliver("fast", 4.0, 400, 100, 100, 100)  # one batch, in the time of its longest: 0.01 s a token
    deliver("slow", 30.0, 100)  # 0.3 s a token
    deliver("steady", 5.0, 50)  # its usual group takes 5 s, a long one 40 s
    now = time.monotonic()
    # The fleet's long group: 400 tokens, the 95th percentile of the groups delivered.
    assert ledger.long_group_s("fast", now) == pytest.approx(4.0)
    assert ledger.long_group_s("slow", now) == pytest.approx(120.0)
    assert ledger.long_group_s("steady", now) == pytest.approx(40.0)
    # Version 2's groups are fresh until version 4 is announced, two steps after version 2's.
    assert ledger.fresh_for_s(2, 1, now) == pytest.approx(t0 + 20.0 + 2 * 10.0 * STEP_SHARE - now)
    at_v2 = GrantRequest(want=1, term=0, version=2)
    # Nobody fast enough has taken work: a swarm all slower than its trainer still gets it.
    ledger.grant("new", 1, 8, 64, now=time.monotonic(), version=2)  # not measured: not a taker that fits
    assert not granter.too_slow("slow", at_v2, time.monotonic()) and not granter.too_slow_until("slow", at_v2)
    assert not granter.too_slow_until("fast", at_v2) and granter.grant_work("fast", at_v2)[0]  # one that fits takes some
    assert granter.too_slow("slow", at_v2, time.monotonic()) and granter.too_slow_until("slow", at_v2) == 3
    assert granter.too_slow("steady", at_v2, time.monotonic())  # its usual time fits: its long groups would not
    assert not granter.too_slow("new", at_v2, time.monotonic())  # not measured yet: it is tried
    # Not measured, it is paced by what its warm-up claims: 0.3 s a token is slow's pace.
    claims = {claim: at_v2.model_copy(update={"claimed_s_per_token": claim}) for claim in (0.3, 0.01)}
    assert granter.too_slow("new", claims[0.3], time.monotonic()) and granter.too_slow_until("new", claims[0.3]) == 3
    assert not granter.too_slow("new", claims[0.01], time.monotonic())
    assert granter.too_slow("slow", claims[0.01], time.monotonic())  # once measured, its claim is not heard
    later = time.monotonic() + REDRAW_S  # nobody took a slot for REDRAW_S: the slow one gets it
    assert not granter.too_slow("slow", at_v2, later)
    assert ledger.long_group_s("slow", t0 + 30.0 + PACE_KEPT_S + 1) is None  # forgotten: it is tried again
    chunked = AsyncGranter(None, 0, tiny_config(tmp_path, sampling={"chunk_tokens": 8}), TrainerState(), ledger)
    assert not chunked.too_slow("slow", at_v2, time.monotonic())


def test_while_the_fleet_joins_a_sampler_not_measured_is_judged_by_its_claim_against_the_fleets(tmp_path):
    """At 256 samplers most of a run's waste was the joining's: before the trainer had timed a
    step apart from the fleet's joining, its first windows went to whoever asked first, and the
    slowest half's groups arrived stale. Until it has three announcements (the first interval
    holds the joining), a sampler is judged by the pace it claims against the fleet's claims: the
    slower half gets no work while others take it. A crowd of fewer than JOINING_CLAIMS_MIN is not
    judged so."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})
    granter = AsyncGranter(None, 0, cfg, TrainerState(version=1), GrantLedger())
    ledger, now = granter.ledger, time.monotonic()
    ledger.announced(0, now - 30.0)
    ledger.announced(1, now - 1.0)
    assert ledger.fresh_for_s(1, 1, now) is None  # the joining's interval alone says nothing of the steps
    asks = {f"s{i}": GrantRequest(want=1, term=0, version=1, claimed_s_per_token=0.01 * (i + 1)) for i in range(10)}
    for sampler_id, request in list(asks.items())[: JOINING_CLAIMS_MIN - 1]:
        ledger.claimed(sampler_id, request.claimed_s_per_token)
    assert granter.fits("s6", asks["s6"], now) is None  # no crowd to judge by
    for sampler_id, request in asks.items():
        ledger.claimed(sampler_id, request.claimed_s_per_token)
    assert [granter.fits(s, request, now) for s, request in asks.items()] == [True] * 5 + [False] * 5
    slower = asks["s0"].model_copy(update={"claimed_s_per_token": 0.2})  # s0 restarted on a slower box
    ledger.claimed("s0", 0.2)  # the median moves with its new claim
    assert granter.fits("s5", asks["s5"], now) and not granter.fits("s0", slower, now)
    ledger.claimed("s0", 0.01)
    assert not granter.too_slow_until("s9", asks["s9"])  # nobody fast enough took work yet
    assert granter.grant_work("s0", asks["s0"])[0]
    assert granter.too_slow_until("s9", asks["s9"]) == 2 and not granter.too_slow_until("s4", asks["s4"])
    assert not granter.too_slow("s9", asks["s9"], time.monotonic() + REDRAW_S)  # none taken since: the slow get it
    ledger.announced(2, now)  # three: the steps' own pace judges
    assert ledger.fresh_for_s(2, 1, now) is not None


async def test_a_versions_slots_go_first_to_samplers_fast_enough_not_to_whoever_asks_first(runs, tmp_path):
    """Counted from the last grant to a sampler fast enough alone, a new version's slots went to
    whoever asked first when they opened (that grant was of the version before, seconds ago): at
    1,000 samplers the slowest took a step's worth every few steps, and it arrived stale. The
    slots opening counts as such a grant: a slow sampler waits REDRAW_S for the fast ones. Its
    refusal costs the trainer no broker request: it read the heartbeat of each sampler it then
    refused (2026-12-07: 380 refusals a step at 1,000 samplers, half its broker requests)."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})
    run = await runs.open(cfg.run.id, "trainer")
    lease = await take_lease(run)
    granter = AsyncGranter(run, lease.term, cfg, TrainerState(version=2), GrantLedger())
    ledger, t0 = granter.ledger, time.monotonic() - 21.0
    for version in range(3):  # a version every 10 s
        ledger.announced(version, t0 + 10.0 * version)
    slots, _ = ledger.grant("slow", 1, 8, 64, now=t0, version=0)
    ledger.delivered("slow", slots[0], arrived=t0 + 30.0, tokens=100)  # 0.3 s a token: a long group takes 30 s
    ledger.accepted(slots[0])
    at_v3 = GrantRequest(want=1, term=lease.term, version=3)
    assert not granter.too_slow("slow", at_v3, time.monotonic())  # none fast enough took work lately
    await granter.ask(3)
    assert granter.too_slow("slow", at_v3, time.monotonic())
    sent = run.nc.stats["out_msgs"]
    refused = await granter.grant("slow", at_v3)
    assert refused.wait_version == 4 and not refused.slots and run.nc.stats["out_msgs"] == sent
    assert not granter.too_slow("slow", at_v3, time.monotonic() + REDRAW_S)  # none took it: the slow one may


def test_a_sampler_a_version_behind_whose_long_group_would_arrive_stale_gets_no_work_until_it_runs_the_new_one(
        tmp_path):
    """At 1,000 samplers (2026-12-07) the stale groups were all granted to samplers still running
    the version before the trainer's (their weights on the way: 7 s median, steps of 11 s), too
    slow for it, while nobody fast enough had taken work for REDRAW_S: the fast ones were
    fetching the new weights. Such a sampler gets none until it runs the trainer's version (it
    is refused naming it), when it is judged as any other; one fast enough is granted work
    behind, as before."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})
    granter = AsyncGranter(None, 0, cfg, TrainerState(version=3), GrantLedger())
    ledger, t0 = granter.ledger, time.monotonic() - 31.0
    for version in range(4):  # a version every 10 s: version 3 at t0 + 30
        ledger.announced(version, t0 + 10.0 * version)
    for sampler_id, took in (("fast", 4.0), ("slow", 30.0)):  # 0.01 and 0.3 s a token
        slots, _ = ledger.grant(sampler_id, 1, 8, 64, now=t0, version=0)
        ledger.delivered(sampler_id, slots[0], arrived=t0 + took, tokens=100)
        ledger.accepted(slots[0])
    now = time.monotonic() + REDRAW_S  # nobody fast enough took work for REDRAW_S
    behind, current = GrantRequest(want=1, term=0, version=2), GrantRequest(want=1, term=0, version=3)
    assert not granter.too_slow("slow", current, now)  # running the trainer's version: the slow may take it
    assert granter.too_slow("slow", behind, now)
    granter.fit_granted = (0.0, "")
    assert granter.too_slow_until("slow", behind) == 3
    assert not granter.too_slow("fast", behind, now) and not granter.too_slow_until("fast", behind)


def test_a_long_group_counts_max_new_tokens_until_the_fleet_delivered_enough_to_say():
    """The first groups to arrive are the short ones: their 95th percentile made a slow sampler's
    long group seem to fit, and its long groups arrived stale as the fleet joined. Until
    LONG_SAMPLES groups have come, a long group counts max_new_tokens."""
    ledger = GrantLedger(max_tokens=512)
    slots, _ = ledger.grant("a", want=1, headroom=8, window=8, now=10.0)
    ledger.delivered("a", slots[0], arrived=11.0, tokens=100)  # 0.01 s a token
    ledger.accepted(slots[0])
    assert ledger.long_group_s("a", 11.0) == pytest.approx(5.12)
    assert ledger.long_group_s("b", 11.0, claimed_s_per_token=0.02) == pytest.approx(10.24)
    for _ in range(LONG_SAMPLES):
        slot = ledger.grant("c", want=1, headroom=8, window=8, now=10.0)[0][0]
        ledger.delivered("c", slot, arrived=10.5, tokens=100)
        ledger.accepted(slot)
    assert ledger.long_group_s("a", 11.0) == pytest.approx(1.0)
    assert GrantLedger().long_group_s("a", 11.0, claimed_s_per_token=0.02) is None  # nothing came yet


def test_a_sampler_refused_as_too_slow_is_not_woken_again_by_budgets_of_its_version():
    """At 1,000 samplers the slow ones, refused, were drawn again by every budget of the same
    version while its slots went untaken, and refused again: a third of the grant requests. The
    refusal names the next version, and budgets of older ones no longer wake the sampler."""
    work = Work(None, "s1", 1, "p")
    work.wait_version = 3  # as a refusal at version 2 said
    for draw in range(20):  # every idle sampler drawn (2 open slots, 1 idle)
        work.follow_budget(GrantBudget(version=2, allowance=8, groups_per_step=4, open=2, idle=1, draw=draw))
        assert work.drawn is None
    work.follow_budget(GrantBudget(version=3, allowance=8, groups_per_step=4, open=2, idle=1, draw=0))
    assert work.drawn == 3


async def test_budgets_that_draw_a_refused_sampler_to_no_ask_do_not_put_off_its_asking_anyway():
    """CI, 2026-12-06: a sampler refused as too slow waits for the next version, and asks anyway
    once the time the trainer said is up. The trainer's redraws, every REDRAW_S while the slots
    went untaken, woke it each time, and each wake started that wait over: it never asked again.
    The sampler that had taken the work then froze, and the run stalled for good. The wait now
    ends when the trainer said, whatever wakes the sampler meanwhile."""
    work = Work(None, "s1", 1, "p")
    before = time.monotonic()
    work.answered(Grant(again_s=7.0, wait_version=3))  # refused at version 2
    assert work.wait_version == 3 and before + 7.0 <= work.ask_by <= time.monotonic() + 7.0
    work.ask_by -= 6.5  # the test's own clock: 0.5 s left

    async def redraw_forever():
        for draw in itertools.count():
            work.follow_budget(GrantBudget(version=2, allowance=8, groups_per_step=4, open=2, idle=1, draw=draw))
            await asyncio.sleep(REDRAW_S / 10)

    redraws, no_weights = asyncio.ensure_future(redraw_forever()), asyncio.Event()
    try:
        async with asyncio.timeout(30):  # it never asked, woken ten times a second
            while not await work.idle(no_weights.wait()):  # woken, not drawn
                assert work.drawn is None
                work.changed.clear()  # as the sampler's loop does
        assert time.monotonic() >= work.ask_by
    finally:
        redraws.cancel()
    work.answered(None)  # no answer: the least wait
    assert work.idle_for_s == IDLE_ASK_MIN_S


def test_the_deadline_of_a_version_is_judged_at_the_pace_of_its_usual_steps_and_moves_with_a_long_one():
    """The first step waits for the fleet to join: at the mean of the steps' times it counted
    for four, and groups were granted that arrived stale. A step running longer than the usual
    ones moves the deadline with it: once it was judged passed, every sampler was refused and a
    step took 90 s, one grant a second."""
    ledger = GrantLedger()
    for version, at in enumerate((0.0, 40.0, 50.0, 60.0, 70.0)):  # joining took 40 s, then 10 s a step
        ledger.announced(version, at)
    step = 10.0 * STEP_SHARE  # erring short
    assert ledger.fresh_for_s(4, 1, now=72.0) == pytest.approx(70.0 + 2 * step - 72.0)  # until version 6
    assert ledger.fresh_for_s(3, 1, now=72.0) == pytest.approx(70.0 + step - 72.0)
    # Version 5 is late: version 4's groups are fresh for at least the step after it.
    assert ledger.fresh_for_s(4, 1, now=130.0) == pytest.approx(step)
    assert ledger.fresh_for_s(2, 1, now=72.0) < 0  # version 4 is out: stale already



def test_the_trainer_measures_each_grant_by_the_groups_it_accepted():
    """A grant is a call the trainer times itself, from the grant to its last group's arrival:
    only groups it accepted count, so a sampler cannot seem faster than what it delivered."""
    ledger = GrantLedger(rate_window_s=60.0)
    slots, _ = ledger.grant("a", want=4, headroom=4, window=8, now=10.0)
    for slot, at in zip(slots, (11.0, 12.0, 13.0, 14.0)):
        assert ledger.delivered("a", slot, arrived=at)
        (ledger.wasted if slot == slots[3] else ledger.accepted)(slot)  # the last one arrived stale
    rates = ledger.measured("a", now=15.0)
    assert (rates.groups_per_s, rates.call_s) == (3 / 4.0, 4.0)  # 3 accepted in the 4 s from grant to last
    junk, _ = ledger.grant("b", want=2, headroom=2, window=8, now=10.0)
    for slot in junk:
        assert ledger.delivered("b", slot, arrived=10.1)
        ledger.wasted(slot)  # refused: not a rate
    ledger.grant("c", want=2, headroom=2, window=8, now=10.0)
    ledger.release("c")  # died holding them
    assert ledger.measured("b", now=15.0).groups_per_s == 0 == ledger.measured("c", now=15.0).groups_per_s


def test_the_sync_time_is_what_the_trainer_saw_not_what_the_heartbeat_says():
    """A sampler's sync time is timed by the trainer, from its announcement of a version to the
    sampler's first request for work naming it; the least of the last few (one busy with a call
    asks after it). The scheduler plans with it, whatever the heartbeat claims."""
    ledger = GrantLedger(rate_window_s=60.0)
    ledger.announced(1, now=100.0)
    slots, _ = ledger.grant("a", want=1, headroom=8, window=8, now=100.5, version=1)  # joined: not a sync
    assert ledger.synced("a") is None
    ledger.announced(2, now=110.0)
    ledger.grant("a", want=1, headroom=8, window=8, now=113.0, version=2)  # after a call: 3 s
    ledger.announced(3, now=120.0)
    ledger.grant("a", want=1, headroom=8, window=8, now=120.8, version=3)
    ledger.grant("a", want=1, headroom=8, window=8, now=125.0, version=3)  # the same version again
    assert ledger.synced("a") == pytest.approx(0.8)
    assert ledger.delivered("a", slots[0], arrived=101.0)
    ledger.accepted(slots[0])
    claims = SamplerStatus(sampler_id="a", version=3, groups_published=1, weight_failures={}, updated_at=0.0,
                           groups_per_s=1000.0, call_s=0.0, sync_s={"3": 0.0})
    (pace,) = delivered_paces([claims], ledger, now=130.0)
    assert (pace.sync_s, pace.call_s) == (pytest.approx(0.8), pytest.approx(0.5))


async def test_a_sampler_claims_the_pace_of_its_warm_up_in_each_request_for_work(runs, tmp_path):
    """A sampler's first requests came with nothing the trainer could pace it by: it measured
    a sampler only once its first call's groups arrived, and in a joining crowd the slowest
    quarter's arrived stale. A sampler now times a short generation before it asks, and each
    request claims that pace. The engine here takes at least 10 ms a token."""
    cfg = tiny_config(tmp_path)
    engine = HFEngine("tiny", cfg.lora, cfg.sampling)
    generate = engine.generate

    def slow(*args, **kwargs):
        out = generate(*args, **kwargs)
        time.sleep(0.01 * max(len(c.token_ids) for completions in out for c in completions))
        return out

    engine.generate = slow
    run = await runs.open(cfg.run.id, "trainer")
    asked = []

    async def decide(sampler_id, request):
        asked.append(request)
        return Grant()

    await serve_grants(run, decide)
    await WeightsPublisher(await take_lease(run)).publish(0, adapter_for_version(engine, 0), TINY_BASE)
    sampler = Sampler(cfg, "s1", await runs.open(cfg.run.id, "sampler", create=False), engine, load_task(cfg.task))
    serving = asyncio.create_task(sampler.serve())
    try:
        await eventually_async(lambda: asked, 60)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    assert asked[0].claimed_s_per_token == sampler.work.claimed_s_per_token >= 0.01
