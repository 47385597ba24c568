"""`echo-rl eval`: the base model and a run's last published weights scored on held-out prompts
(workers/operator/heldout.py)."""

from __future__ import annotations

from pathlib import Path

import orjson

from echo.process.logs import configure_logging
from workers.arguments import at_least, run_directory

NAME = "eval"


def register(sub) -> None:
    evaluate = sub.add_parser("eval", help="score the base model and the run's last published weights on held-out prompts")
    evaluate.add_argument("--run", required=True, type=Path, help="run directory")
    evaluate.add_argument("--prompts", type=at_least(1), default=50, help="held-out prompts to score (greedy)")
    evaluate.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                          help="override the run's config here, e.g. this machine's model.device")
    evaluate.add_argument("--log-json", action="store_true")


def run(args) -> int:
    from workers.operator.heldout import evaluate_run

    run_dir = run_directory(args.run, "config.toml")  # checked before logging is set up
    configure_logging(args.log_json, run=run_dir.name, role="eval", worker="eval")
    print(orjson.dumps(evaluate_run(run_dir, args.prompts, args.set, keep_earlier=True), option=orjson.OPT_INDENT_2).decode())
    return 0
