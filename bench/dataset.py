"""Benchmark: a user's dataset of N rows (verl's parquet schema) named on the trainer
(echo/tasks/dataset.py, streams/prompts.py): reading it into shards, publishing its prompts, a
sampler reading prompts from the broker, each in its own process so its peak memory is its own;
against the whole file read as Python rows (`pq.read_table(...).to_pylist()`, how the math task
read a dataset), in the same run.

    .venv/bin/python -m bench.dataset [--rows 1000000] [--draws 2000]

Writes bench/results/dataset.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_results
from echo.train.metrics import peak_rss_mb


def write_file(path: Path, rows: int) -> None:
    """A verl-format parquet file, written a batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    for start in range(0, rows, 50_000):
        batch = [{"data_source": "gsm8k", "ability": "math", "extra_info": {"index": i},
                  "prompt": [{"role": "user", "content": f"Natalia sold {i} clips in April and half as many in May. "
                                                         "How many clips did she sell? Put the answer in \\boxed{}."}],
                  "reward_model": {"style": "rule", "ground_truth": str(i + i // 2)}}
                 for i in range(start, min(rows, start + 50_000))]
        table = pa.Table.from_pylist(batch)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def peak_mb() -> float:
    return round(peak_rss_mb(), 1)


def phase(name: str, path: str, url: str, draws: int) -> dict:
    """One measurement, in this (fresh) process."""
    from echo.config import TaskConfig
    from echo.tasks import load_task

    before = peak_mb()  # the imports' share
    started = time.perf_counter()
    if name == "whole":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return {"seconds": round(time.perf_counter() - started, 2), "rows": len(rows), "peak_mb": peak_mb(),
                "imports_mb": before}
    task = load_task(TaskConfig(name="dataset", params={"path": path}))
    if name == "build":
        return {"seconds": round(time.perf_counter() - started, 2), "rows": task.manifest["rows"],
                "shards": len(task.manifest["shards"]["train"]), "peak_mb": peak_mb(), "imports_mb": before}
    from streams.client import open_run
    from streams.prompts import PromptShards, publish_prompts

    async def main() -> dict:
        run = await open_run(url, "bench-data", "bench")
        try:
            if name == "publish":
                manifest, shards = task.published_prompts()
                began = time.perf_counter()
                digest = await publish_prompts(run, manifest, shards)
                return {"seconds": round(time.perf_counter() - began, 2), "manifest": digest,
                        "megabytes": round(sum(f.stat().st_size for f in shards) / 1e6, 1), "peak_mb": peak_mb()}
            shards = PromptShards(run, name.removeprefix("sample:"))
            rng, began = random.Random(0), time.perf_counter()
            for _ in range(draws):
                await shards.prompt(rng.randrange(2**31))
            return {"draws": draws, "seconds": round(time.perf_counter() - began, 2), "peak_mb": peak_mb(),
                    "imports_mb": before}
        finally:
            await run.close()

    return asyncio.run(main())


def in_process(name: str, path: Path, url: str, draws: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.dataset", "--phase", name, "--path", str(path), "--url", url,
                          "--draws", str(draws)], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--draws", type=int, default=2000, help="prompts a sampler reads, at random")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.path, args.url, args.draws)))
        return
    from streams.server import NatsServer

    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        path, env = Path(tmp) / "train.parquet", {**os.environ, "ECHO_CACHE": str(Path(tmp) / "cache")}
        started = time.perf_counter()
        write_file(path, args.rows)
        report = {"rows": args.rows, "file_mb": round(path.stat().st_size / 1e6, 1),
                  "write_s": round(time.perf_counter() - started, 1)}
        report["whole_file_as_rows"] = in_process("whole", path, server.url, args.draws, env)
        report["trainer_reads_into_shards"] = in_process("build", path, server.url, args.draws, env)
        report["trainer_publishes_prompts"] = in_process("publish", path, server.url, args.draws, env)
        digest = report["trainer_publishes_prompts"]["manifest"]
        report["sampler_reads_prompts"] = in_process(f"sample:{digest}", path, server.url, args.draws, env)
        report["shards_peak_vs_whole"] = round(report["trainer_reads_into_shards"]["peak_mb"]
                                               / report["whole_file_as_rows"]["peak_mb"], 2)
    print(write_results("dataset.json", report).read_text())


if __name__ == "__main__":
    main()
