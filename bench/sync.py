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

Full weights (issue 47): `--full MB` publishes synthetic bf16 weights of that size instead,
each version changing `--changed` of their elements (what bench/delta.py measured of real
training), once as whole versions and once as deltas (echo/weights/delta.py, the trainer's packing and
anchors); the samplers are followers alone (rebuild, check the digest, hold the weights), spread
over `--relays` relays, each with its own shaped link when `--wan` is given:

    .venv/bin/python -m bench.sync --full 64 --changed 0.01 --samplers 16 --relays 4 --wan 50 100

Writes bench/results/sync.json (sync-wan.json with --wan, sync-full[-wan].json with --full): per
(N, relays, weights), the median and max over versions.
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
import safetensors.torch
import torch

from bench.common import write_results
from echo.config import TrainerConfig
from streams.server import NatsServer, ServerConfig, free_port

APPLIED = "bench.applied"  # core NATS subject on which each worker reports (worker, version, time)


async def worker(url: str, run_id: str, model: str, worker_id: int, full: bool) -> None:
    from echo.process.logs import configure_logging
    from streams.client import open_run
    from streams.weights import WeightsFollower

    configure_logging(level="warning")
    torch.set_num_threads(1)
    engine = None  # full weights: the follower holds them, no model is loaded
    if not full:
        from echo.config import LoraConfig, SamplingConfig
        from echo.engines.hf import HFEngine

        engine = HFEngine(model, LoraConfig(), SamplingConfig())
    run = await open_run(url, run_id, f"bench-{worker_id}")
    follower = await WeightsFollower(run, model).start()
    version = -1
    while True:
        announcement, shards = await follower.wait_for(version + 1)
        if engine is not None:
            engine.load_weights(shards)
        version = announcement.version
        await run.nc.publish(APPLIED, orjson.dumps([worker_id, version, time.time()]))


class FullWeights:
    """Synthetic full weights in bf16, `mb` of them in tensors of 4 MB, each version changing
    `changed` of the elements of the one before; published whole or as the trainer's deltas."""

    def __init__(self, mb: float, changed: float, deltas: bool, trainer: TrainerConfig = TrainerConfig()):
        self.generator = torch.Generator().manual_seed(0)
        count = max(1, round(mb / 4))
        self.tensors = {f"w{i}": torch.randn(2 << 20, generator=self.generator).to(torch.bfloat16)
                        for i in range(count)}
        self.changed, self.deltas, self.trainer = changed, deltas, trainer  # when a version goes whole
        self.size = sum(t.numel() * t.element_size() for t in self.tensors.values())

    def step(self) -> None:
        for name, tensor in self.tensors.items():
            moved = torch.rand(tensor.shape, generator=self.generator) < self.changed
            self.tensors[name] = torch.where(moved, (tensor.float() * 1.01 + 1e-3).to(torch.bfloat16), tensor)

    async def publish(self, weights, version: int, model: str):
        from echo.weights import delta
        from echo.weights.digest import tensors_digest

        before = dict(self.tensors)
        if version:
            self.step()
        digest, base = tensors_digest(self.tensors), weights.newest
        if self.deltas and base is not None:
            packed = delta.pack(delta.encode(before, self.tensors))
            if not delta.send_whole(version, weights.chain[0].version, len(packed), self.size,
                                    self.trainer.delta_every, self.trainer.delta_max_share):
                return await weights.publish(version, [packed], model, "full", digest=digest, delta_of=base.version)
        shards = [safetensors.torch.save({name: tensor}) for name, tensor in self.tensors.items()]
        return await weights.publish(version, shards, model, "full", digest=digest)


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


async def measure(hub: NatsServer, model: str, n: int, versions: int, relays: int,
                  wan: tuple[float, float] | None = None, full: FullWeights | None = None) -> dict:
    from echo.config import LoraConfig
    from echo.model.loading import load_model
    from echo.model.policy import make_policy
    from echo.weights.shards import weights_shards
    from streams.client import open_run
    from streams.lease import take_lease
    from streams.weights import WeightsPublisher
    from workers.operator.relay import loopback_relay_args

    kind = "adapter" if full is None else "delta" if full.deltas else "whole"
    run_id = f"sync{n}r{relays}{kind}"
    policy = make_policy(load_model(model)[0], LoraConfig()) if full is None else None
    run = await open_run(hub.url, run_id, "bench-trainer")
    weights = WeightsPublisher(await take_lease(run))
    applied: dict[int, dict[int, float]] = {}

    async def on_applied(msg):
        worker_id, version, at = orjson.loads(msg.data)
        applied.setdefault(version, {})[worker_id] = at

    await run.nc.subscribe(APPLIED, cb=on_applied)
    # Each site (its relay, or its samplers) reaches the hub through a WAN link of its own when there is one.
    procs, worker_urls = [], []
    for site in range(max(relays, 1)):
        worker_url, leaf_url = hub.url, hub.leaf_url
        if wan:
            link, link_port = start_link(hub.config.leaf_port if relays else hub.port, wan)
            procs.append(link)
            worker_url, leaf_url = f"nats://127.0.0.1:{link_port}", f"nats-leaf://127.0.0.1:{link_port}"
        if relays:
            port, store = free_port(), hub.store_dir / "relays" / f"{run_id}-{site}"
            procs.append(subprocess.Popen([sys.executable, "-m", "workers.cli", *loopback_relay_args(
                leaf_url, run_id, port, store, domain=f"site{site}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            worker_url = f"nats://127.0.0.1:{port}"
        worker_urls.append(worker_url)
    procs += [
        subprocess.Popen([sys.executable, "-m", "bench.sync", "--worker", worker_urls[i % len(worker_urls)], run_id,
                          model, str(i), "full" if full else "adapter"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(n)
    ]
    try:
        latencies, hub_copies, sizes = [], [], []
        for version in range(versions + 1):  # version 0 warms up: every worker loaded and following
            sent_before, published_at = hub_out_bytes(hub.config.http_port), time.time()
            if full is not None:
                size = (await full.publish(weights, version, model)).size
            else:
                with torch.no_grad():  # random like trained weights: a constant would compress on the leaf link
                    generator = torch.Generator().manual_seed(version)
                    for name, p in policy.named_parameters():
                        if "lora_B" in name:
                            p.copy_(torch.randn(p.shape, generator=generator) / 1000)
                shards = list(weights_shards(policy, 2**30))
                size = sum(map(len, shards))
                await weights.publish(version, shards, model)
            deadline = time.monotonic() + (600 if version == 0 else 300)
            while len(applied.get(version, {})) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {version}: {len(applied.get(version, {}))} of {n} samplers")
                await asyncio.sleep(0.005)
            if version > 0:
                latencies.append(max(applied[version].values()) - published_at)
                hub_copies.append((hub_out_bytes(hub.config.http_port) - sent_before) / size)
                sizes.append(size)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        await run.close()
    return {
        "samplers": n,
        "relay": relays > 0,
        "relays": relays,
        "weights": kind,
        "wan": {"rtt_ms": wan[0], "mbit": wan[1]} if wan else None,
        "adapter_mb": round(statistics.median(sizes) / 1e6, 2),  # what a version published: adapter, whole or delta
        "whole_mb": round(full.size / 1e6, 2) if full else None,
        "latency_median_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(max(latencies), 3),
        "hub_sent_per_version_x_adapter": round(statistics.median(hub_copies), 3),
    }


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        url, run_id, model, worker_id, kind = sys.argv[2:7]
        asyncio.run(worker(url, run_id, model, int(worker_id), kind == "full"))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--samplers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--wan", nargs=2, type=float, metavar=("RTT_MS", "MBIT"),
                        help="put a shaped link (round trip, bandwidth) between the hub and each site")
    parser.add_argument("--relays", type=int, nargs="+", default=[0, 1], help="0: samplers on the hub")
    parser.add_argument("--full", type=float, metavar="MB", help="synthetic full weights of this size, whole and "
                        "as deltas, instead of the model's adapter")
    parser.add_argument("--changed", type=float, default=0.01,
                        help="with --full: the share of elements a version changes")
    args = parser.parse_args()

    from echo.model.loading import resolve_model

    resolve_model(args.model)  # convert once, before the workers start
    weights = [None] if args.full is None else [FullWeights(args.full, args.changed, deltas)
                                                 for deltas in (False, True)]
    with tempfile.TemporaryDirectory() as store, NatsServer(store, ServerConfig(leaf_port=free_port(), http_port=free_port())) as hub:
        results = [asyncio.run(measure(hub, args.model, n, args.versions, relays, args.wan, full))
                   for full in weights for relays in args.relays for n in args.samplers]
    report = {"model": args.model, "cpus": os.cpu_count(), "versions": args.versions, "full_mb": args.full,
              "changed": args.changed if args.full else None, "results": results}
    name = "sync" + ("-full" if args.full else "") + ("-wan" if args.wan else "")
    write_results(f"{name}.json", report)
    for r in results:
        print(f"N={r['samplers']} relays={r['relays']} {r['weights']}: all samplers on the new version after "
              f"{r['latency_median_s']} s (median of {args.versions}; max {r['latency_max_s']} s); hub sent "
              f"{r['hub_sent_per_version_x_adapter']}x a version ({r['adapter_mb']} MB)")


if __name__ == "__main__":
    main()
