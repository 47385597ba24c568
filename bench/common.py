"""Where the benchmarks write their JSON: bench/results/, or $BENCH_RESULTS (`make bench-quick`
writes bench/results/quick/, so a quick run never overwrites the full results)."""

from __future__ import annotations

import os
from pathlib import Path


def results_dir() -> Path:
    folder = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
