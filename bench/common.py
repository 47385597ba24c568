"""Where the benchmarks write their JSON: bench/results/, or $BENCH_RESULTS (`make bench-quick`
writes bench/results/quick/, so a quick run never overwrites the full results)."""

from __future__ import annotations

import os
from pathlib import Path

import orjson


def results_dir() -> Path:
    folder = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(name: str, report: dict) -> Path:
    """`report` as indented JSON in results_dir() / name; returns the path."""
    out = results_dir() / name
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return out
