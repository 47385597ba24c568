"""Benchmark: weight fan-out. For N = 1, 2, 4, 8 sampler processes, each following the weights
subject and swapping the adapter into a real model (the samplers' own code path:
WeightsFollower -> HFEngine.load_weights, without generating), connected either to the hub
directly or to one site relay (`echo-rl relay`, a leaf node mirroring the weights), and with
`--wan RTT_MS MBIT` across a shaped link between the hub and the site (bench/wan_proxy.py: the
samplers' connections, or the relay's leaf connection, cross it; the link is shared), measure

- latency: from the start of WeightsPublisher.publish (store + announce) until the slowest sampler
  runs the new version;
- hub bytes: what the hub sent (its /varz out_bytes) per version, as a multiple of the
  adapter's size. Directly, each sampler pulls its own copy; through a relay, one copy.

    .venv/bin/python -m bench.sync [--model smollm2] [--samplers 1 2 4 8] [--versions 5] [--wan 50 100]

Writes bench/results/sync.json (sync-wan.json with --wan): per (N, relay), the median and max
over versions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import orjson
import torch

from bench.common import write_results
from streams.server import NatsServer, free_port

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
        announcement, shards = await follower.wait_for(version + 1)
        engine.load_weights(shards)
        version = announcement.version
        await run.nc.publish(APPLIED, orjson.dumps([worker_id, version, time.time()]))


def hub_out_bytes(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/varz") as response:
        return orjson.loads(response.read())["out_bytes"]


def start_link(target_port: int, wan: tuple[float, float]) -> tuple[subprocess.Popen, int]:
    """A shaped link (bench/wan_proxy.py) to the hub's `target_port`: (process, its port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.wan_proxy", str(port), f"127.0.0.1:{target_port}",
                             str(wan[0]), str(wan[1])])
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the WAN proxy did not start") from None
            time.sleep(0.05)


async def measure(hub: NatsServer, model: str, n: int, versions: int, relay: bool,
                  wan: tuple[float, float] | None = None) -> dict:
    from echo.config import LoraConfig
    from echo.models import load_model
    from echo.policy import make_policy, weights_shards
    from streams.client import open_run
    from streams.lease import take_lease
    from streams.weights import WeightsPublisher
    from workers.relay import loopback_relay_args

    run_id = f"sync{n}{'relay' if relay else ''}"
    policy = make_policy(load_model(model)[0], LoraConfig())
    run = await open_run(hub.url, run_id, "bench-trainer")
    weights = WeightsPublisher(await take_lease(run))
    applied: dict[int, dict[int, float]] = {}

    async def on_applied(msg):
        worker_id, version, at = orjson.loads(msg.data)
        applied.setdefault(version, {})[worker_id] = at

    await run.nc.subscribe(APPLIED, cb=on_applied)
    # The site (its relay, or its samplers) reaches the hub through the WAN link when there is one.
    procs, worker_url, leaf_url = [], hub.url, hub.leaf_url
    if wan:
        link, link_port = start_link(hub.leaf_port if relay else hub.port, wan)
        procs.append(link)
        worker_url, leaf_url = f"nats://127.0.0.1:{link_port}", f"nats-leaf://127.0.0.1:{link_port}"
    if relay:
        port, store = free_port(), hub.store_dir / "relays" / run_id
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.cli", *loopback_relay_args(leaf_url, run_id, port, store)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        worker_url = f"nats://127.0.0.1:{port}"
    procs += [
        subprocess.Popen([sys.executable, "-m", "bench.sync", "--worker", worker_url, run_id, model, str(i)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(n)
    ]
    try:
        latencies, hub_copies, size = [], [], 0
        for version in range(versions + 1):  # version 0 warms up: every worker loaded and following
            with torch.no_grad():  # random like trained weights: a constant would compress on the leaf link
                generator = torch.Generator().manual_seed(version)
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=generator) / 1000)
            shards = list(weights_shards(policy, 2**30))
            size = sum(map(len, shards))
            sent_before, published_at = hub_out_bytes(hub.http_port), time.time()
            await weights.publish(version, shards, model)
            deadline = time.monotonic() + (600 if version == 0 else 60)
            while len(applied.get(version, {})) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {version}: {len(applied.get(version, {}))} of {n} samplers")
                await asyncio.sleep(0.005)
            if version > 0:
                latencies.append(max(applied[version].values()) - published_at)
                hub_copies.append((hub_out_bytes(hub.http_port) - sent_before) / size)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        await run.close()
    return {
        "samplers": n,
        "relay": relay,
        "wan": {"rtt_ms": wan[0], "mbit": wan[1]} if wan else None,
        "adapter_mb": round(size / 1e6, 2),
        "latency_median_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(max(latencies), 3),
        "hub_sent_per_version_x_adapter": round(statistics.median(hub_copies), 3),
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
    parser.add_argument("--wan", nargs=2, type=float, metavar=("RTT_MS", "MBIT"),
                        help="put a shaped link (round trip, bandwidth) between the hub and the site")
    args = parser.parse_args()

    from echo.models import resolve_model

    resolve_model(args.model)  # convert once, before the workers start
    with tempfile.TemporaryDirectory() as store, NatsServer(store, leaf_port=free_port(), http_port=free_port()) as hub:
        results = [asyncio.run(measure(hub, args.model, n, args.versions, relay, args.wan))
                   for relay in (False, True) for n in args.samplers]
    report = {"model": args.model, "cpus": os.cpu_count(), "versions": args.versions, "results": results}
    out = write_results(("sync-wan.json" if args.wan else "sync.json"), report)
    for r in results:
        print(f"N={r['samplers']} {'relay ' if r['relay'] else 'direct'}: all samplers on the new version after "
              f"{r['latency_median_s']} s (median of {args.versions}; max {r['latency_max_s']} s); hub sent "
              f"{r['hub_sent_per_version_x_adapter']}x the adapter ({r['adapter_mb']} MB)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
