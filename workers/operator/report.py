"""`echo-rl report`: a run's reward, staleness and learner utilisation plotted (workers/operator/charts.py)."""

from __future__ import annotations

from pathlib import Path

from echo.process.logs import configure_logging
from workers.arguments import run_directory

NAME = "report"
NEEDS = ("matplotlib",)


def register(sub) -> None:
    report = sub.add_parser("report", help="plot reward, staleness and learner utilisation to <run>/report.png")
    report.add_argument("--run", required=True, type=Path, help="run directory")
    report.add_argument("--log-json", action="store_true")


def run(args) -> int:
    from workers.operator.charts import write_report

    run_dir = run_directory(args.run, "metrics.jsonl")
    configure_logging(args.log_json, run=run_dir.name, role="report", worker="report")
    print(write_report(run_dir))
    return 0
