"""`echo-rl plan`: which samplers to pay for, from the capacity model (workers/plan.py) on a fleet
file or a live run's registry."""

from __future__ import annotations

import asyncio
from pathlib import Path

from echo.config import ConfigError
from echo.logs import configure_logging
from streams.credentials import credentials_of
from workers.commands.common import at_least

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
    from echo.capacity import LearnerPace
    from streams.client import PATIENCE_S, open_run
    from streams.registry import read_learner, read_statuses
    from workers.plan import measured

    run = await open_run(args.nats, args.run_id, "planner", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=0, give_up_s=PATIENCE_S)
    try:
        pace, statuses = await read_learner(run), await read_statuses(run)
    finally:
        await run.close()
    if pace is None:
        raise ConfigError(f"run {args.run_id!r}: its trainer has not finished a step yet, so its step time is unknown")
    return LearnerPace(pace.step_s, pace.groups_per_step, pace.max_staleness), measured(statuses)


def run(args) -> int:
    from workers.plan import fleet_from_file, plan_report, print_plan

    if bool(args.fleet) == bool(args.nats and args.run_id):
        raise ConfigError("plan: give --fleet FILE, or --nats URL with --run-id ID")
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target {args.target}: a utilisation above 0, at most 1")
    configure_logging(level="error")  # the plan is the output; a failure is said in one line
    learner, workers = fleet_from_file(args.fleet) if args.fleet else asyncio.run(live_fleet(args))
    print_plan(plan_report(learner, workers, args.target, args.max_staleness), args.json)
    return 0
