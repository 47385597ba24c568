"""`echo-rl plan`: which samplers a run should pay for. The fleet comes from the run's live
registry (each sampler's measured rates, sync times and cost, and the trainer's pace) or from a
TOML description; the answer from the capacity model (echo/fleet/capacity.py)."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from echo.config import ConfigError, format_errors
from echo.fleet.capacity import SCHEDULED, LearnerPace, Plan, SamplerPace, best_staleness, cheapest, sampler_pace
from echo.process.logs import configure_logging
from echo.wire.messages import SamplerStatus
from streams.credentials import credentials_of
from workers.arguments import at_least


class Fleet(BaseModel):
    """A fleet file: `[learner]` and one `[[samplers]]` table per sampler (docs/operations.md, Scheduling)."""

    model_config = ConfigDict(extra="forbid")
    learner: LearnerPace
    samplers: list[SamplerPace]


def fleet_from_file(path: Path) -> tuple[LearnerPace, list[SamplerPace]]:
    try:
        fleet = Fleet.model_validate(tomllib.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such fleet file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not TOML: {e}") from None
    except ValidationError as e:
        raise ConfigError(f"{path}: {format_errors(e, model=Fleet)}") from None
    return fleet.learner, fleet.samplers


def measured(statuses: list[SamplerStatus]) -> list[SamplerPace]:
    """The samplers the scheduler may use, and has rates for (a sampler that has not finished a
    call yet has none)."""
    return [sampler_pace(s) for s in statuses if s.state in SCHEDULED and s.groups_per_s > 0]


def plan_report(learner: LearnerPace, samplers: list[SamplerPace], target: float, max_staleness: int) -> dict:
    plan = cheapest(learner, samplers, target)
    by_staleness = best_staleness(learner, samplers, target, max_staleness)
    return {
        "learner": vars(learner),
        "target_utilisation": target,
        "plan": _plan_json(plan, samplers),
        "by_staleness": [{"max_staleness": p.learner.max_staleness, **_summary(p)} for p in
                         sorted(by_staleness, key=lambda p: p.learner.max_staleness)],
        "cheapest_staleness": by_staleness[0].learner.max_staleness,
    }


def _summary(plan: Plan) -> dict:
    return {"active": list(plan.active), "utilisation": round(plan.utilisation, 4), "cycle_s": round(plan.cycle_s, 3),
            "cost_per_hour": round(plan.cost_per_hour, 4), "cost_per_step": round(plan.cost_per_step, 6),
            "reached": plan.reached, "exact": plan.exact}


def _plan_json(plan: Plan, samplers: list[SamplerPace]) -> dict:
    return {**_summary(plan), "samplers": [
        {**vars(w), "chosen": w.id in plan.active, "why": plan.reasons[w.id]} for w in samplers]}


def format_report(report: dict) -> str:
    learner, plan = report["learner"], report["plan"]
    lines = [f"learner: T = {learner['step_s']:.2f} s a step, B = {learner['groups_per_step']} groups, "
             f"S = {learner['max_staleness']}; target utilisation {report['target_utilisation']:.0%}", ""]
    rows = [("sampler", "device", "groups/s", "call s", "sync s", "cost/h", "chosen", "why")]
    rows += [(w["id"], w["device"] or "-", f"{w['groups_per_s']:.3g}", f"{w['call_s']:.3g}", f"{w['sync_s']:.3g}",
              f"{w['cost_per_hour']:.3g}", "yes" if w["chosen"] else "no", w["why"]) for w in plan["samplers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)) + "  " + r[-1] for r in rows]
    reached = "" if plan["reached"] else "  (the target is out of reach: not enough throughput at any cost)"
    lines += ["", f"predicted utilisation {plan['utilisation']:.0%}, {plan['cycle_s']:.2f} s a step, "
              f"cost {plan['cost_per_hour']:.3g}/h = {plan['cost_per_step']:.3g} per trained step{reached}",
              "", "by staleness bound:"]
    for p in report["by_staleness"]:
        mark = "  <- cheapest per step" if p["max_staleness"] == report["cheapest_staleness"] else ""
        lines.append(f"  S={p['max_staleness']}: {p['utilisation']:.0%} busy, {p['cost_per_step']:.3g} per step, "
                     f"{len(p['active'])} sampler(s){'' if p['reached'] else ', target not reached'}{mark}")
    return "\n".join(lines)


def print_plan(report: dict, as_json: bool) -> None:
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if as_json else format_report(report))


NAME = "plan"


def register(sub) -> None:
    plan = sub.add_parser("plan", help="which samplers to pay for: the capacity model on a fleet file or a live "
                          "run's registry")
    plan.add_argument("--fleet", type=Path, help="a fleet TOML file ([learner] and [[samplers]]; docs/operations.md, Scheduling)")
    plan.add_argument("--nats", help="a live run's broker (with --run-id): its samplers' measured rates and costs")
    plan.add_argument("--run-id")
    plan.add_argument("--creds", help="on a secured broker: an observer's or the trainer's credentials")
    plan.add_argument("--tls-ca")
    plan.add_argument("--target", type=float, default=0.9, help="the learner utilisation to reach (0-1]")
    plan.add_argument("--max-staleness", type=at_least(0), default=4, help="try staleness bounds 0 to N")
    plan.add_argument("--json", action="store_true", help="one JSON object instead of the table")


async def live_fleet(args):
    """The capacity model's inputs from a live run: the trainer's pace and the registry."""
    from echo.fleet.capacity import LearnerPace
    from streams.client import PATIENCE_S, open_run
    from streams.registry import read_statuses, read_trainer_status

    run = await open_run(args.nats, args.run_id, "planner", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=0, give_up_s=PATIENCE_S)
    try:
        pace, statuses = await read_trainer_status(run), await read_statuses(run)
    finally:
        await run.close()
    if pace is None:
        raise ConfigError(f"run {args.run_id!r}: its trainer has not finished a step yet, so its step time is unknown")
    return LearnerPace(pace.step_s, pace.groups_per_step, pace.max_staleness), measured(statuses)


def run(args) -> int:

    if bool(args.fleet) == bool(args.nats and args.run_id):
        raise ConfigError("plan: give --fleet FILE, or --nats URL with --run-id ID")
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target {args.target}: a utilisation above 0, at most 1")
    configure_logging(level="error")  # the plan is the output; a failure is said in one line
    learner, workers = fleet_from_file(args.fleet) if args.fleet else asyncio.run(live_fleet(args))
    print_plan(plan_report(learner, workers, args.target, args.max_staleness), args.json)
    return 0
