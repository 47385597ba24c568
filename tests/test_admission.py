"""The admission budget: its arithmetic, and leases taken concurrently on a real server."""

import asyncio

from echo.admission import allowance, sampler_cap
from echo.protocol import AdmissionBudget
from streams.admission import leases_taken, publish_budget, take_leases
from streams.client import open_run


def test_allowance_covers_the_staleness_window_plus_lost_groups():
    assert allowance(version=0, max_staleness=0, groups_per_step=4, lost=0) == 4  # on-policy: one step
    assert allowance(version=3, max_staleness=1, groups_per_step=4, lost=2) == 22


def test_a_sampler_behind_the_trainer_gets_a_smaller_cap():
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=5, groups_per_step=4) == 28
    assert sampler_cap(budget_version=5, budget_allowance=28, sampler_version=3, groups_per_step=4) == 20


def test_the_leases_never_pass_the_cap_however_many_samplers_race(nats_server):
    async def main():
        run = await open_run(nats_server.url, "lease", "test")
        assert await take_leases(run, 2, sampler_version=0) == 0  # no budget yet: no work
        await publish_budget(run, AdmissionBudget(version=2, allowance=13, groups_per_step=4))
        assert await take_leases(run, 8, sampler_version=0) == 5  # two versions behind: cap 13 - 2 * 4
        grants = await asyncio.gather(*(take_leases(run, 2, sampler_version=2) for _ in range(12)))
        assert sum(grants) == 8 and (await leases_taken(run))[0] == 13
        assert await take_leases(run, 1, sampler_version=2) == 0
        await publish_budget(run, AdmissionBudget(version=3, allowance=17, groups_per_step=4))
        assert await take_leases(run, 8, sampler_version=3) == 4
        await run.close()

    asyncio.run(main())
