"""The admission budget: its arithmetic, the fair share of the grant ledger, and the trainer
granting work to samplers that race for it on a real server."""

import asyncio

from echo.admission import GrantLedger, allowance, sampler_cap
from echo.checkpoint import TrainerState
from echo.protocol import GrantRequest
from streams.admission import leases_granted
from streams.client import open_run
from streams.grants import request_grant
from streams.lease import take_lease
from tests.conftest import tiny_config
from workers.trainer import Admission, PullRequests


def test_allowance_covers_the_staleness_window_plus_lost_groups():
    assert allowance(version=0, max_staleness=0, groups_per_step=4, lost=0) == 4  # on-policy: one step
    assert allowance(version=3, max_staleness=1, groups_per_step=4, lost=2) == 22


def test_a_sampler_behind_the_trainer_gets_a_smaller_cap():
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=5, groups_per_step=4) == 28
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=3, groups_per_step=4) == 20


def test_each_sampler_asking_holds_at_most_an_equal_share_of_the_window():
    ledger = GrantLedger(active_s=10)
    assert ledger.grant("a", want=8, headroom=100, window=8, now=0) == (8, True)  # alone: the whole window
    assert ledger.grant("b", want=8, headroom=92, window=8, now=1) == (4, True)  # two ask: 4 each
    assert ledger.grant("a", want=8, headroom=88, window=8, now=2) == (0, True)  # a holds 8 already
    for _ in range(6):
        ledger.delivered("a")
    assert ledger.grant("a", want=8, headroom=88, window=8, now=3) == (2, True)
    assert ledger.grant("c", want=8, headroom=3, window=8, now=4) == (1, True)  # scarce headroom: a third of it
    # a and b stop asking (dead, or a hoarder gone quiet): after active_s the window is c's again.
    assert ledger.grant("c", want=8, headroom=50, window=8, now=30) == (7, True)
    ledger.forget_held()
    assert ledger.grant("a", want=8, headroom=50, window=8, now=31) == (4, True)
    ledger.delivered("z")  # granted by a previous trainer: nothing held, nothing goes negative
    assert ledger.held["z"] == 0


def _ask(run, sampler_id, epoch, version, want=2, pull_request_id=None):
    request = GrantRequest(want=want, epoch=epoch, version=version, pull_request_id=pull_request_id)
    return request_grant(run, sampler_id, request)


def test_grants_never_pass_the_cap_however_many_samplers_race(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 1})

    async def main():
        run = await open_run(nats_server.url, "lease", "trainer")
        sampler = await open_run(nats_server.url, "lease", "sampler", create=False)
        assert (await _ask(sampler, "a", 1, 0)).groups == 0  # no trainer yet: no work
        lease = await take_lease(run)
        orders = Admission(run, cfg, TrainerState(version=2), GrantLedger())
        await orders.start()
        await orders.ask(2)  # leases up to (2 + 1 + 1) * 4 = 16
        assert (await _ask(sampler, "a", lease.epoch, 0, want=8)).groups == 8  # two versions behind: cap 16 - 2 * 4
        grants = await asyncio.gather(*(_ask(sampler, f"s{i}", lease.epoch, 2) for i in range(12)))
        assert sum(g.groups for g in grants) == 8 and await leases_granted(run) == 16
        assert (await _ask(sampler, "s0", lease.epoch, 2)).groups == 0
        assert (await _ask(sampler, "s0", lease.epoch, 3)).groups == 0  # a version the trainer has not published
        assert (await _ask(sampler, "s0", lease.epoch - 1, 2)).groups == 0  # a previous trainer's weights
        await orders.ask(3)
        assert (await _ask(sampler, "s0", lease.epoch, 3, want=8)).model_dump() == {
            "schema_version": 4, "groups": 0, "more": True}  # s0 holds 2, more than its share: ask again later
        assert (await _ask(sampler, "late", lease.epoch, 3, want=8)).groups == 1  # 14 asking: a share of 1 of 8

        # A restarted trainer numbers its grants on from the count in KV.
        again = Admission(run, cfg, TrainerState(version=3), GrantLedger())
        await again.start()
        assert again.leases == 17
        await orders.subscription.unsubscribe()
        await again.subscription.unsubscribe()
        await sampler.close()
        await run.close()

    asyncio.run(main())


def test_sequential_groups_are_granted_once_and_only_for_the_current_request(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, run={"mode": "sequential"}, trainer={"groups_per_step": 6, "reissue_after_s": 0.1})

    async def main():
        run = await open_run(nats_server.url, "seq", "trainer")
        sampler = await open_run(nats_server.url, "seq", "sampler", create=False)
        lease = await take_lease(run)
        orders = PullRequests(run, cfg, TrainerState(), GrantLedger())
        await orders.start()
        await orders.ask(0)
        request = orders.request
        grants = await asyncio.gather(*(_ask(sampler, f"s{i}", lease.epoch, 0, 4, request.request_id) for i in range(3)))
        assert sum(g.groups for g in grants) == 6  # in arrival order: the first alone may get its whole want
        assert (await _ask(sampler, "s0", lease.epoch, 0, 4, request.request_id)).model_dump() == {
            "schema_version": 4, "groups": 0, "more": False}
        await asyncio.sleep(0.1)
        await orders.on_wait(2)  # nothing came for reissue_after_s: a new request for the missing groups
        assert (await _ask(sampler, "s0", lease.epoch, 0, 4, request.request_id)).groups == 0  # the old one is over
        again = orders.request.request_id
        assert (await _ask(sampler, "s0", lease.epoch, 0, 4, again)).groups == 1  # 2 groups, 3 asking: 1 each at most
        assert (await _ask(sampler, "s1", lease.epoch, 0, 4, again)).groups == 1
        assert (await _ask(sampler, "s2", lease.epoch, 0, 4, again)).groups == 0
        await orders.subscription.unsubscribe()
        await sampler.close()
        await run.close()

    asyncio.run(main())


def test_no_work_is_granted_until_min_samplers_have_asked(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "min_samplers": 2})

    async def main():
        run = await open_run(nats_server.url, "fleet", "trainer")
        lease = await take_lease(run)
        orders = Admission(run, cfg, TrainerState(), GrantLedger())
        await orders.ask(0)
        asked = GrantRequest(want=2, epoch=lease.epoch, version=0)
        assert (await orders.grant("early", asked)).model_dump() == {"schema_version": 4, "groups": 0, "more": True}
        assert (await orders.grant("early", asked)).groups == 0  # asking again does not count twice
        assert (await orders.grant("late", asked)).groups == 2
        assert (await orders.grant("early", asked)).groups == 2
        await run.close()

    asyncio.run(main())
