"""Benchmark: time from "the trainer published version v" to "all N samplers run v", for
N = 1, 2, 4, 8 sampler processes on one loopback nats-server, each following the weights
subject and swapping the adapter into a real model (the samplers' own code path:
WeightsFollower -> HFEngine.load_adapter), without generating.

    .venv/bin/python bench/sync.py [--model smollm2] [--samplers 1 2 4 8] [--versions 5]

Writes bench/results/sync.json: per N, the median and max over versions of the slowest
sampler's latency (from the start of publish_weights: store + announce + fetch + apply), and the adapter size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

APPLIED = "bench.applied"  # core NATS subject on which each worker reports (worker, version, time)


async def worker(url: str, run_id: str, model: str, worker_id: int) -> None:
    from echo.config import LoraConfig, SamplingConfig
    from echo.engines.hf import HFEngine
    from echo.logs import configure_logging
    from streams.client import open_run
    from streams.weights import WeightsFollower

    configure_logging(level="warning")
    torch.set_num_threads(1)
    engine = HFEngine(model, LoraConfig(), SamplingConfig())
    run = await open_run(url, run_id, f"bench-{worker_id}")
    follower = await WeightsFollower(run, model).start()
    version = -1
    while True:
        announcement, data = await follower.wait_for(version + 1)
        engine.load_adapter(data)
        version = announcement.version
        await run.nc.publish(APPLIED, orjson.dumps([worker_id, version, time.time()]))


async def measure(url: str, model: str, n: int, versions: int) -> dict:
    from echo.config import LoraConfig
    from echo.models import load_model
    from echo.policy import adapter_bytes, add_lora
    from streams.client import open_run
    from streams.weights import publish_weights

    run_id = f"sync{n}"
    policy = add_lora(load_model(model)[0], LoraConfig())
    run = await open_run(url, run_id, "bench-trainer")
    applied: dict[int, dict[int, float]] = {}

    async def on_applied(msg):
        worker_id, version, at = orjson.loads(msg.data)
        applied.setdefault(version, {})[worker_id] = at

    await run.nc.subscribe(APPLIED, cb=on_applied)
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", url, run_id, model, str(i)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(n)
    ]
    try:
        latencies, size = [], 0
        for version in range(versions + 1):  # version 0 warms up: every worker loaded and following
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.fill_(version / 1000)
            data = adapter_bytes(policy)
            size = len(data)
            published_at = time.time()
            await publish_weights(run, version, data, model)
            deadline = time.monotonic() + (600 if version == 0 else 60)
            while len(applied.get(version, {})) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {version}: {len(applied.get(version, {}))} of {n} samplers")
                await asyncio.sleep(0.005)
            if version > 0:
                latencies.append(max(applied[version].values()) - published_at)
    finally:
        for p in procs:
            p.kill()
        await run.close()
    return {
        "samplers": n,
        "adapter_mb": round(size / 1e6, 2),
        "latency_median_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(max(latencies), 3),
    }


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        url, run_id, model, worker_id = sys.argv[2:6]
        asyncio.run(worker(url, run_id, model, int(worker_id)))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--samplers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()

    from echo.models import resolve_model
    from streams.server import NatsServer

    resolve_model(args.model)  # convert once, before the workers start
    with tempfile.TemporaryDirectory() as store, NatsServer(store) as server:
        results = [asyncio.run(measure(server.url, args.model, n, args.versions)) for n in args.samplers]
    report = {"model": args.model, "cpus": os.cpu_count(), "relay": False, "results": results}
    out = Path(__file__).parent / "results" / "sync.json"
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    for r in results:
        print(f"N={r['samplers']}: all samplers on the new version after {r['latency_median_s']} s "
              f"(median of {args.versions}; max {r['latency_max_s']} s), adapter {r['adapter_mb']} MB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
