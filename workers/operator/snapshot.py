"""A run's state at one instant, read from the broker alone: the trainer's status, each
sampler's registry entry with what the trainer counted of it, the fleet summed up, the rollout
stream and the storage. `echo-rl status` (workers/operator/status.py) draws it in a terminal,
the page (workers/operator/page.py) in a browser: one snapshot, two views."""

from __future__ import annotations

import statistics
import time

from echo.wire.messages import SamplerStatus, TrainerStatus
from streams.client import RunClient
from streams.lease import current_term
from streams.quarantine import read_quarantine
from streams.registry import read_statuses, read_trainer_status
from streams.rollouts import account_storage, rollouts_backlog
from streams.run_config import run_config

REFRESH_S = 2.0


async def snapshot(run: RunClient) -> dict:
    trainer, samplers = await read_trainer_status(run), await read_statuses(run)
    quarantined, now = await read_quarantine(run), time.time()
    version = trainer.version if trainer else None
    stream = await rollouts_backlog(run)
    relays: dict[str, list[str]] = {}
    for s in samplers:
        relays.setdefault(s.relay or "hub", []).append(s.sampler_id)
    return {
        "run_id": run.names.run_id,
        "at": now,
        "trainer": None if trainer is None else {
            "term": await current_term(run), "step": trainer.step, "version": trainer.version,
            "rewards": trainer.rewards, "utilisation": trainer.utilisation, "step_s": trainer.step_s,
            "publish_s": trainer.publish_s, "accounting": trainer.accounting, "rejected": trainer.rejected,
            "seen_s_ago": round(now - trainer.updated_at, 1), "finished": trainer.finished,
            "staleness": trainer.staleness, "steps": trainer.steps, "elapsed_s": trainer.elapsed_s,
            "eta_s": trainer.eta_s, "pace_s": pace_s(trainer), "scalars": trainer.scalars,
            "samples": [s.model_dump() for s in trainer.samples], "model": trainer.model, "task": trainer.task,
            "overdue": not trainer.finished and now - trainer.updated_at > OVERDUE_PACES * pace_s(trainer) + OVERDUE_S,
        },
        "samplers": (rows := [sampler_row(s, version, quarantined, trainer, now) for s in samplers]),
        "fleet": fleet_summary(rows),
        "stream": stream,
        "storage": await account_storage(run),
        "relays": relays,
        "config": await run_config(run),  # what the run trains with, as its trainer published it
    }


# The trainer's status is overdue (shown as such) after this many of its steps' seconds and this
# many more: a status comes once a step, and a step's time varies.
OVERDUE_PACES, OVERDUE_S = 2, 10.0


def sampler_row(s: SamplerStatus, version: int | None, quarantined: dict[str, str], trainer: TrainerStatus | None,
                now: float) -> dict:
    """A sampler's line of the snapshot, from its heartbeat (bounded at decode: echo/wire/messages.py)
    and what the trainer counted of it."""
    strikes, slots = (trainer.strikes, trainer.slots) if trainer else ({}, {})
    ended = slots.get(s.sampler_id)
    return {
        "id": s.sampler_id, "state": "quarantined" if s.sampler_id in quarantined else s.state,
        "version": s.version, "lag": None if version is None or s.version < 0 else version - s.version,
        "engine": s.engine, "device": s.device, "relay": s.relay or "hub",
        "ranks": s.ranks, "ranks_restarted": s.ranks_restarted, "rank_lost": s.rank_lost,
        "groups_per_s": s.groups_per_s, "tokens_per_s": s.tokens_per_s,
        "sync_s": round(statistics.fmean(s.sync_s.values()), 3) if s.sync_s else None,
        "cost_per_hour": s.cost_per_hour, "groups_published": s.groups_published,
        "weight_failures": s.weight_failures, "quarantine_reason": quarantined.get(s.sampler_id),
        "strikes": strikes.get(s.sampler_id, 0), "seen_s_ago": round(now - s.updated_at, 1),
        "slots_ended": ended.ended if ended else 0, "slots_undelivered": ended.undelivered if ended else 0,
    }


SLOWEST = 10


def fleet_summary(rows: list[dict]) -> dict:
    """The samplers at a glance, however many: how many in each state, the spread of their pace
    (groups/s, of those taking work) and of their lag behind the trainer, and the slowest ones."""
    working = sorted((s for s in rows if s["state"] == "active"), key=lambda s: (s["groups_per_s"], s["id"]))

    def spread(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        values = sorted(values)
        return {f"p{q}": values[min(len(values) - 1, len(values) * q // 100)] for q in (10, 50, 90)}

    states: dict[str, int] = {}
    for s in rows:
        states[s["state"]] = states.get(s["state"], 0) + 1
    return {"samplers": len(rows), "by_state": dict(sorted(states.items())),
            "groups_per_s": spread([s["groups_per_s"] for s in working]),
            "lag": spread([s["lag"] for s in rows if s["lag"] is not None]),
            "slowest": [s["id"] for s in working[:SLOWEST]]}


def pace_s(trainer: TrainerStatus) -> float:
    """A step's seconds, waits included: the trainer's status comes once a step."""
    return trainer.step_s / trainer.utilisation if trainer.utilisation > 0 else trainer.step_s
