"""Benchmark: our object-store transfer (streams/objects.py) against nats-py's ObjectStore,
put and get, on one loopback nats-server, in one run so the ratio is fair on a noisy machine.

    .venv/bin/python -m bench.weights [--sizes 20 256] [--repeats 3]

Writes bench/results/weights.json. Speeds are MB/s (1 MB = 10^6 bytes), best of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import tempfile
import time

from nats.js.api import ObjectMeta, ObjectMetaOptions

from bench.common import write_results
from streams.client import open_run
from streams.objects import CHUNK_SIZE, get_object, put_object
from streams.server import NatsServer


async def best_seconds(repeats: int, action) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await action()
        times.append(time.perf_counter() - started)
    return min(times)


async def measure(url: str, size_mb: int, repeats: int) -> dict:
    run = await open_run(url, f"bench{size_mb}", "bench")
    bucket, data = run.names.weights_bucket, os.urandom(size_mb * 10**6)

    async def library_get():
        sink = io.BytesIO()  # writeinto: nats-py's get() into bytes is quadratic
        await run.weights.get("lib", writeinto=sink)
        assert len(sink.getvalue()) == len(data)

    async def ours_get():
        assert len(await get_object(run.js, bucket, "ours")) == len(data)

    same_chunks = ObjectMeta(name="lib", options=ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
    result = {
        "size_mb": size_mb,
        "chunk_size": CHUNK_SIZE,
        # The library at our chunk size (1 MiB; its default is 128 KiB), put and get alike: the
        # ratios then measure the pipelining and batching, not the chunk size.
        "library_put_s": await best_seconds(repeats, lambda: run.weights.put("lib", data, meta=same_chunks)),
        "ours_put_s": await best_seconds(repeats, lambda: put_object(run.js, bucket, "ours", data)),
        "library_get_s": await best_seconds(repeats, library_get),
        "ours_get_s": await best_seconds(repeats, ours_get),
    }
    for op in ("put", "get"):
        for who in ("library", "ours"):
            result[f"{who}_{op}_mb_s"] = round(size_mb / result[f"{who}_{op}_s"], 1)
        result[f"{op}_speedup"] = round(result[f"library_{op}_s"] / result[f"ours_{op}_s"], 2)
    await run.weights.delete("lib")
    await run.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 256], help="object sizes in MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as store, NatsServer(store) as server:
        results = [asyncio.run(measure(server.url, size, args.repeats)) for size in args.sizes]
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "results": results}
    write_results("weights.json", report)
    for r in results:
        print(f"{r['size_mb']:>4} MB  put: ours {r['ours_put_mb_s']} MB/s vs library {r['library_put_mb_s']} "
              f"(x{r['put_speedup']})  get: ours {r['ours_get_mb_s']} vs library {r['library_get_mb_s']} "
              f"(x{r['get_speedup']})")


if __name__ == "__main__":
    main()
