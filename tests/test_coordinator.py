"""The trainer's coordinator (workers/trainer/coordinator.py) on a real server: it chooses from the
registry, and a fleet that is no longer measured leaves no sampler on standby."""

import time
from types import SimpleNamespace

from echo.fleet.grants import GrantLedger
from echo.wire.messages import SamplerStatus, TrainerStatus
from streams.registry import put_status
from tests.conftest import tiny_config
from workers.trainer.coordinator import Coordinator


def _status(sampler_id: str, cost: float) -> SamplerStatus:
    return SamplerStatus(sampler_id=sampler_id, version=1, groups_published=4, weight_failures={},
                         updated_at=time.time(), cost_per_hour=cost, groups_per_s=2.0, call_s=1.0, sync_s={"1": 0.5})


def _deliver_in(ledger: GrantLedger, sampler_id: str, groups: int, seconds: float) -> None:
    """A grant of `groups` slots whose groups the trainer accepted `seconds` later."""
    now = time.monotonic()
    slots, _ = ledger.grant(sampler_id, groups, headroom=groups, window=1000, now=now - seconds)
    for slot in slots:
        assert ledger.delivered(sampler_id, slot, now)
        ledger.accepted(slot)


async def test_a_fleet_no_longer_measured_leaves_no_sampler_on_standby(runs, tmp_path):
    # S = 2, T = 2 s, B = 4: a sampler at 2 groups/s delivers 2 x min(2, 2.5) = 4 a step, enough alone.
    cfg = tiny_config(tmp_path, scheduler={"enabled": True}, trainer={"groups_per_step": 4, "max_staleness": 2})
    pace = SimpleNamespace(status=TrainerStatus(step_s=2.0, groups_per_step=4, max_staleness=2, version=1,
                                                utilisation=1.0, updated_at=time.time()))

    run = await runs.open("coordinated", "trainer")
    standby: set[str] = set()
    ledger = GrantLedger()
    coordinator = Coordinator(run, cfg, standby, pace, ledger)
    for sampler_id, cost in (("cheap", 1.0), ("dear", 3.0)):
        await put_status(run, _status(sampler_id, cost))
        _deliver_in(ledger, sampler_id, groups=2, seconds=1.0)  # 2 groups/s, as its heartbeat says
    await coordinator.choose()
    assert standby == {"dear"}
    for sampler_id in ("cheap", "dear"):  # both entries expired, or both restarted and unmeasured
        await run.registry.delete(sampler_id)
    await coordinator.choose()
    assert standby == set()  # a restarted "dear" takes work, so it can be measured again
