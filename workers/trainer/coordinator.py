"""ECHO-2's cost-aware activation, run inside the trainer process (scheduler.enabled).

Every `scheduler.every_s` the coordinator reads the run's registry and the rates and sync times
the trainer measured of each sampler (echo/fleet/grants.py). When a sampler joined, left (its entry
expired) or its measured rates drifted, it chooses again the cheapest set of samplers
that reaches `scheduler.target_utilisation` at the trainer's measured pace (echo/fleet/capacity.py) and
publishes the choice (streams/schedule.py): the others go on standby, keeping their weights
current and taking no slots, and the trainer grants them none. A sampler not yet measured (the
trainer has accepted no grant's groups from it) takes work until it is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog

from echo.config import EchoConfig
from echo.fleet.capacity import SCHEDULED, LearnerPace, SamplerPace, cheapest, replan_reason, sampler_pace
from echo.fleet.grants import GrantLedger
from echo.wire.messages import SamplerStatus, Schedule, TrainerStatus
from streams.client import BROKER_ERRORS, RunClient
from streams.registry import read_statuses
from streams.schedule import publish_schedule

log = structlog.get_logger()


def delivered_paces(statuses: list[SamplerStatus], ledger: GrantLedger, now: float) -> list[SamplerPace]:
    """The samplers the scheduler may use, at the rates and sync times the trainer measured of
    them (a heartbeat's are the sampler's word: one claiming 1000 groups/s at no cost had the
    honest ones put on standby and the run stopped); their cost as they say, and their sync
    time too until the trainer has seen one. One the trainer has not measured yet takes work
    until it has."""
    paces = []
    for status in statuses:
        rates, synced = ledger.measured(status.sampler_id, now), ledger.synced(status.sampler_id)
        if status.state in SCHEDULED and rates.groups_per_s > 0:
            pace = replace(sampler_pace(status), groups_per_s=rates.groups_per_s, call_s=rates.call_s)
            paces.append(pace if synced is None else replace(pace, sync_s=synced))
    return paces


class Coordinator:
    def __init__(self, run: RunClient, cfg: EchoConfig, standby: set[str], pace, ledger: GrantLedger):
        self.run, self.cfg, self.ledger = run, cfg, ledger
        self.pace = pace  # the trainer's Pace: its `status` after each step
        self.standby = standby  # the trainer's grants read this set: it is changed in place
        self.used: dict[str, SamplerPace] = {}  # the measurements the current choice was made from

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.scheduler.every_s)
            try:
                await self.choose()
            except BROKER_ERRORS as e:  # the broker restarting: the next round reads again
                log.warning("scheduler.read_failed", reason=repr(e))

    async def choose(self) -> None:
        pace: TrainerStatus | None = self.pace.status
        if pace is None:  # no step yet: no pace to plan for
            return
        samplers = {w.id: w for w in delivered_paces(await read_statuses(self.run), self.ledger, time.monotonic())}
        why = replan_reason(self.used, samplers, self.cfg.scheduler.drift)
        if why is None:
            return
        if not samplers:  # none measured (all gone, or restarted): every sampler takes work until measured
            self.used = {}
            self.standby.clear()
            return
        learner = LearnerPace(pace.step_s, pace.groups_per_step, pace.max_staleness)
        scheduler = self.cfg.scheduler
        active = tuple(w for w in self.used if w not in self.standby)  # the set chosen before
        plan = cheapest(learner, list(samplers.values()), scheduler.target_utilisation, active, scheduler.switch_margin)
        standby = set(samplers) - set(plan.active)
        await publish_schedule(self.run, Schedule(
            active=sorted(plan.active), standby=sorted(standby), predicted_utilisation=min(plan.utilisation, 1.0),
            cost_per_step=plan.cost_per_step, why=why, updated_at=time.time()))
        # Only once published: a publish that failed leaves the choice to be made again next round.
        self.used = samplers
        self.standby.clear()
        self.standby.update(standby)
        # With what it chose from (the pace, the measured samplers, the set it kept), so anyone can
        # check the choice against the capacity model (tests/test_scheduling.py).
        log.info("scheduler.chose", active=sorted(plan.active), standby=sorted(standby), why=why,
                 predicted_utilisation=round(plan.utilisation, 3), cost_per_step=round(plan.cost_per_step, 6),
                 reached=plan.reached, version=pace.version, learner=vars(learner), kept=sorted(active),
                 samplers=[vars(s) for s in samplers.values()])
