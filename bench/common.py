"""Where the benchmarks write their JSON: bench/results/, or $BENCH_RESULTS (`make bench-quick`
writes bench/results/quick/, so a quick run never overwrites the full results), and on what
machine, how busy: every result records the cores and the load average before and while the
bench ran (a figure taken at load 10 on 2 cores is not one taken on an idle box)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import orjson

LOAD_SAMPLE_S = 5.0


class MachineLoad:
    """The 1-minute load average when the bench's process began and every LOAD_SAMPLE_S since
    (a daemon thread: the bench's own work counts, as it does on the machine)."""

    def __init__(self):
        self.began = os.getloadavg()[0]
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), load)
        threading.Thread(target=self._sample, daemon=True, name="machine-load").start()

    def _sample(self) -> None:
        while True:
            time.sleep(LOAD_SAMPLE_S)
            self.samples.append((time.monotonic(), os.getloadavg()[0]))

    def report(self, since: float | None = None) -> dict:
        """Cores, the load before the bench, and its mean and peak while it ran (since `since`,
        a time.monotonic(), when given: one shape of several)."""
        during = [load for at, load in self.samples if since is None or at >= since] or [os.getloadavg()[0]]
        return {"cores": os.cpu_count(), "load_before": round(self.began, 2),
                "load_during_mean": round(sum(during) / len(during), 2), "load_during_max": round(max(during), 2)}


MACHINE = MachineLoad()


def results_dir() -> Path:
    folder = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(name: str, report: dict) -> Path:
    """`report` as indented JSON in results_dir() / name, with the machine's load over the
    bench's whole process; says where, and returns the path."""
    out = results_dir() / name
    out.write_bytes(orjson.dumps({"machine": MACHINE.report(), **report}, option=orjson.OPT_INDENT_2))
    print(f"wrote {out}")
    return out
