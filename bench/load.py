"""Benchmark: the real protocol at reasoning shapes. The real trainer loop (intake, scorer,
grants, accounting, weights publishing), a real nats-server and real samplers (grants,
weights following, heartbeats, publishing), with the two computations this machine cannot do at
that shape replaced by bench-only stand-ins that live here and nowhere else (no config selects
them):

- SyntheticEngine: a sampler's generation. Completion lengths are long-tailed (log-normal, capped
  at sampling.max_new_tokens), token ids and log-probs random; the rows decode in parallel at
  `--tokens-per-s` each (a GPU's batch), so a call lasts as long as its longest completion; with
  sampling.chunk_tokens it calls the sampler between chunks, which swaps in newer weights
  (partial rollouts).
- SyntheticLearner: the trainer's model. A step takes `--learner-us-per-token` for each token it
  trains (tokens older than the staleness bound are not trained); weights are a 4 MB stand-in
  for a LoRA adapter.

Reported per shape: the step's time apart from the learner's, as a share of the learner's (the
broker's and the trainer's own overhead: fetching, scoring, publishing, acks, accounting),
the trainer's and the broker's peak resident memory, the tokens wasted (dropped as stale, or
not trained as older than the bound), and how long each version took from its publish to a
sampler running it.

    .venv/bin/python -m bench.load --samplers 8 32 64 --staleness 1 2 --chunks 0 1024 --steps 4

Writes bench/results/load.json (a shape measured again replaces its earlier result).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import math
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import psutil
import torch

from bench.common import MACHINE, results_dir, write_results
from bench.sync import start_link
from echo.config import EchoConfig, load_config, validate_config
from echo.engines.base import CompletionOutput, NewerWeights
from echo.model.loading import base_model_digest, encode_chat, load_model
from echo.process.logs import configure_logging
from echo.tasks import load_task
from echo.train.checkpoint import TrainerState
from echo.train.learner import Batch
from echo.train.metrics import peak_rss_mb, read_metrics
from echo.trust.noise import Draw
from echo.trust.proof import ProofSettings, SamplingProof
from streams.client import cancel_until_done, open_run
from streams.server import NatsCluster, NatsServer, ServerConfig, free_port
from workers.operator.relay import loopback_relay_args
from workers.operator.swarm import stop_processes
from workers.sampler.sampler import Sampler
from workers.trainer.model import Stepped

ADAPTER_MB = 4.0  # a LoRA adapter of rank 16 on a 1-2B model is a few MB


@functools.cache
def _tokenizer(model_name: str):
    """One per process: a thousand samplers share it."""
    return load_model(model_name)[1]


class SyntheticEngine:
    """Bench only: generation at `tokens_per_s` with log-normal lengths (median `median_tokens`)."""

    name, device, dtype = "hf", torch.device("cpu"), torch.float32
    keyed_noise = False  # synthetic tokens: nothing drawn
    routing = None  # a dense model's

    def __init__(self, cfg: EchoConfig, tokens_per_s: float, median_tokens: int, seed: int):
        self.tokenizer = _tokenizer(cfg.model.name)
        self.vocab = len(self.tokenizer)
        self.max_new, self.chunk = cfg.sampling.max_new_tokens, cfg.sampling.chunk_tokens or cfg.sampling.max_new_tokens
        self.tokens_per_s, self.median = tokens_per_s, median_tokens
        self.rng = np.random.default_rng(seed)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def load_weights(self, shards: list[bytearray]) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        # Synthetic tokens: no noise is drawn, keyed or not (its trainer checks no proof).
        rows, rng = len(prompts) * n, self.rng if seed is None else np.random.default_rng(seed)
        limit = max_tokens or self.max_new
        lengths = np.minimum(limit, np.ceil(rng.lognormal(math.log(self.median), 1.0, rows))).astype(int)
        changes: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
        produced = 0
        while True:
            step = min(self.chunk, limit - produced)
            # The rows decode in parallel (a GPU's batch): a chunk takes its longest row's tokens.
            time.sleep(min(step, int(lengths.max()) - produced) / self.tokens_per_s)
            produced += step
            if produced >= lengths.max():
                break
            version = newer_weights.between_chunks() if newer_weights is not None and self.chunk < limit else None
            if version is not None:
                for row in np.flatnonzero(lengths > produced):
                    changes[row].append((produced, version))
        eos = self.tokenizer.eos_token_id
        generations = []
        for row, length in enumerate(lengths):
            stops = length < limit
            ids = rng.integers(0, self.vocab, length).tolist()
            ids = [t if t != eos else eos - 1 for t in ids]  # no end of sequence but the last
            if stops:
                ids[-1] = eos
            generations.append(CompletionOutput(
                token_ids=ids, logprobs=rng.uniform(-3.0, -0.01, length).tolist(),
                text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason="stop" if stops else "length",
                version_changes=tuple(changes[row])))
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]


class SyntheticLearner:
    """Bench only: the trainer's model, with a step of `seconds_per_token` a token trained."""

    def __init__(self, cfg: EchoConfig, seconds_per_token: float, adapter_mb: float = ADAPTER_MB):
        _, self.tokenizer = load_model(cfg.model.name)
        # Drawn once: a version differs in its first bytes. Drawing 4 MB a version took 41 ms, a
        # learner's cost the publish phase was charged with (0.7% of the reasoning shape's step).
        self.adapter = bytearray(random.randbytes(int(adapter_mb * 2**20)))
        self.vocab_size = len(self.tokenizer)
        self.cfg, self.seconds_per_token = cfg, seconds_per_token
        self.state, self.ranks, self.stop = TrainerState(), SimpleNamespace(world=1), threading.Event()
        self.base_model, self.kind, self.routing = base_model_digest(cfg.model.name), "lora", None  # a dense model
        self.proof = SamplingProof(torch.nn.Linear(1, 1), 0, ProofSettings(cfg.sampling.temperature, 0.0, 1.0, keep=1))
        self.check_many = None  # proves nothing: verify_fraction 0

    def resume(self) -> None:
        pass

    def train(self, batch: Batch, version: int | None = None) -> Stepped:
        """A step's time, slept; synthetic tokens prove nothing (`version` unused)."""
        groups = [r.group for r in batch.groups]
        oldest = batch.oldest_version
        tokens = sum(max(0, len(c.token_ids) - g.sampled_from(oldest)) for g in groups for c in g.completions)
        every = sum(len(c.token_ids) for g in groups for c in g.completions)
        seconds = max(tokens * self.seconds_per_token, 1e-6)
        time.sleep(seconds)
        rewards = [reward for r in batch.groups for reward in r.rewards]
        return Stepped({"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "is_ratio_mean": 1.0,
                        "is_ratio_max": 1.0, "is_truncated_fraction": 0.0, "is_masked_fraction": 0.0,
                        "mismatch_kl": 0.0, "grad_norm": 0.0, "reward_mean": float(np.mean(rewards)),
                        "reward_std": float(np.std(rewards)), "tokens": tokens, "untrained_tokens": every - tokens,
                        "sequences": batch.sequences, "passes": 1,
                        "train_seconds": seconds})

    def save(self, state: TrainerState) -> None:
        pass  # no checkpoint: the bench measures the protocol

    def write_weights(self, version: int) -> list[Path]:
        path = self.cfg.run_dir / "weights" / f"v{version:06d}.bin"
        self.adapter[:8] = version.to_bytes(8, "little")
        path.write_bytes(self.adapter)
        for old in sorted(path.parent.glob("v*.bin"))[: -self.cfg.trainer.keep_versions]:
            old.unlink()
        return [path]

    def remember(self, version: int) -> None:
        self.proof.remember(version)

    def close(self) -> None:
        pass


async def trainer_role(cfg: EchoConfig, seconds_per_token: float, usage_file: Path, adapter_mb: float) -> None:
    """The trainer's process; its peak memory and CPU seconds written to `usage_file` at the end,
    with the seconds its granter spent answering grant requests and reading heartbeats (the
    work that grows with the samplers). Its learner sleeps, so its CPU is the trainer's own broker
    work (fetching, scoring, granting, publishing, acks, accounting), which a trainer host pays
    on any machine."""
    from workers.trainer import granter, holders
    from workers.trainer.trainer import serve  # the real trainer, given the stand-in model

    configure_logging(json=True, level="warning", progress=False)  # to its log: the report counts the warnings

    spent = [timed(granter.Granter, ("grant",)), timed(holders.Holders, ("read_heartbeats",))]  # filled as they run
    outcomes = tally_grants(granter.Granter)

    def cpu_s() -> float:  # its scoring processes' included, once they ended
        return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                               resource.RUSAGE_CHILDREN)))

    began, first_step = cpu_s(), []  # after the imports; once its first step is in (the fleet joined)

    def watch_first_step() -> None:
        while not read_metrics(cfg.run_dir):
            time.sleep(0.2)
        first_step.extend([cpu_s(), dict(outcomes)])  # at once: read at the end, maybe meanwhile

    threading.Thread(target=watch_first_step, daemon=True).start()
    try:
        await serve(cfg, lambda: SyntheticLearner(cfg, seconds_per_token, adapter_mb))
    finally:
        ended = cpu_s()
        usage_file.write_bytes(orjson.dumps({"peak": round(peak_rss_mb() * 2**20), "cpu_s": ended - began,
                                             "after_first_step_cpu_s": ended - first_step[0] if first_step else None,
                                             "granter_s": spent[0] | spent[1], "grant_outcomes": outcomes,
                                             "grant_outcomes_after_first_step":
                                                 outcomes - Counter(first_step[1]) if first_step else {}}))


def timed(cls, names: tuple[str, ...]) -> dict[str, float]:
    """Bench only: the seconds each of `cls`'s async methods `names` spends, summed, and its calls
    (under "<name>_calls"), wrapped in place."""
    spent = dict.fromkeys(names, 0.0) | dict.fromkeys((f"{name}_calls" for name in names), 0)
    for name in names:
        method = getattr(cls, name)

        async def wrapped(self, *args, _method=method, _name=name, **kwargs):
            began = time.perf_counter()
            spent[f"{_name}_calls"] += 1
            try:
                return await _method(self, *args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - began
        setattr(cls, name, wrapped)
    return spent


def tally_grants(cls) -> Counter:
    """Bench only: `cls.grant`'s answers counted by what they were (which asks a step could do
    without), wrapped in place."""
    outcomes, grant = Counter(), cls.grant

    async def tallied(self, sampler_id, request):
        answer = await grant(self, sampler_id, request)
        outcomes["slots" if answer.slots else "too_slow" if answer.wait_version else
                 "behind" if request.version < self.version else "more" if answer.more else "none_left"] += 1
        return answer
    cls.grant = tallied
    return outcomes


async def samplers_role(cfg: EchoConfig, speeds: list[float], median_tokens: int, running, urls: list[str],
                        first: int = 0, churn: float = 0.0, measure=None) -> list:
    """Samplers s<first>, s<first + 1>, ..., decoding at each of `speeds` (tokens/s a row), each on
    the next of `urls` (the hub, or the sites' relays) in turn, while `running()`; a `churn`
    share of them dies once during the run, at a random time, and comes back under the same id
    (a new process name) a few seconds later. `measure(run)` runs once at the end, while their
    heartbeats are still in the registry. Returns each version's time from its announcement to
    a sampler running it."""
    count = len(speeds)
    # Each sampler's generation sleeps in a thread: enough threads that none waits for another.
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(count + 8))
    task = load_task(cfg.task)

    async def start(i: int) -> tuple[Sampler, asyncio.Task]:
        run = await open_run(urls[(first + i) % len(urls)], cfg.run.id, f"sampler-s{first + i}", create=False)
        engine = SyntheticEngine(cfg, speeds[i], median_tokens, seed=first + i)
        sampler = Sampler(cfg, f"s{first + i}", run, engine, task)
        return sampler, asyncio.create_task(sampler.serve())

    started = []
    for i in range(count):
        if not running():  # the trainer, or another samplers process, ended before this fleet was up
            raise RuntimeError("the run ended while its samplers were starting")
        started.append(await start(i))
    syncs: list[float] = []  # from hearing of a version to running it
    dying = sorted(random.Random(first).sample(range(count), round(churn * count)))
    deaths = {i: time.monotonic() + random.Random(first + i).uniform(5.0, 30.0) for i in dying}
    while running():
        await asyncio.sleep(0.5)
        failed = [t for _, t in started if t.done()]
        if failed:
            raise RuntimeError(f"a sampler stopped: {failed[0].exception()!r}")
        for i, when in list(deaths.items()):
            if time.monotonic() >= when:  # it dies; comes back under its id a few seconds later
                del deaths[i]
                sampler, serving = started[i]
                syncs += sampler.weights.syncs.values()
                await cancel_until_done([serving])
                await sampler.run.close()
                await asyncio.sleep(2.0)
                started[i] = await start(i)
    if measure is not None:
        await measure(started[0][0].run)
    syncs += [seconds for s, _ in started for seconds in s.weights.syncs.values()]
    await cancel_until_done([t for _, t in started])  # nats-py may swallow a cancellation (streams/client.py)
    await asyncio.gather(*(sampler.run.close() for sampler, _ in started))  # one by one, 500 outlasted a minute
    return syncs


async def registry_and_view(run, out: dict) -> None:
    """What the run's registry holds once 1,000 samplers beat, and what `echo-rl status` costs to
    read and draw it (the page's event is the same snapshot)."""
    import io

    from rich.console import Console

    from workers.operator.snapshot import snapshot
    from workers.operator.status import render

    info = await run.js.stream_info(f"KV_{run.names.registry_bucket}")
    began = time.perf_counter()
    snap = await snapshot(run)
    read = time.perf_counter() - began
    began = time.perf_counter()
    Console(file=io.StringIO(), width=200).print(render(snap))
    out.update(registry_entries=info.state.messages, registry_writes=info.state.last_seq,
               registry_kb=round(info.state.bytes / 1024), snapshot_s=round(read, 3),
               render_s=round(time.perf_counter() - began, 3), snapshot_kb=round(len(orjson.dumps(snap)) / 1024))


def samplers_process(args) -> None:
    """--role samplers: a slice of the fleet in a process of its own, till SIGTERM; its syncs to --usage-file."""
    import signal

    cfg = load_config(args.config)
    every = speeds(argparse.Namespace(**{**vars(args), "samplers": args.samplers[0]}))

    async def main():
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        return await samplers_role(cfg, every[args.first : args.first + args.count], args.median_tokens,
                                   lambda: not stopped.is_set(), args.urls, args.first, args.churn)

    args.usage_file.write_bytes(orjson.dumps(asyncio.run(main())))


def start_sites(hub: NatsServer, relays: int, wan: list[float] | None, store: Path) -> tuple[list[str], list]:
    """`relays` sites, each a relay (`echo-rl relay`) whose leaf connection to the hub (a
    cluster's node with the leaf port) crosses a shaped link of its own when `wan` (RTT ms,
    Mbit/s) is given: (the relays' URLs, processes)."""
    urls, procs = [], []
    for site in range(relays):
        leaf_url = hub.leaf_url
        if wan:
            link, link_port = start_link(hub.config.leaf_port, tuple(wan))
            procs.append(link)
            leaf_url = f"nats-leaf://127.0.0.1:{link_port}"
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "workers.cli",
             *loopback_relay_args(leaf_url, "load", port, store / f"site{site}", domain=f"site{site}")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"nats://127.0.0.1:{port}")
    return urls, procs


def hub_for(args, store: Path) -> NatsServer | NatsCluster:
    """The hub: one nats-server, or `--cluster` nodes routed into one (relays join the first)."""
    if args.cluster > 1:
        return NatsCluster(store, args.cluster, leaf_port=free_port())
    return NatsServer(store, ServerConfig(leaf_port=free_port(), advertise_leaf=False))


def run_shape(args, chunk_tokens: int, max_staleness: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, hub_for(args, Path(tmp) / "nats") as server:
        nodes = server.nodes if isinstance(server, NatsCluster) else [server]
        cfg = validate_config({
            "run": {"id": "load", "dir": tmp, "steps": args.steps},
            "model": {"name": "tiny"},
            "sampling": {"group_size": args.group_size, "max_new_tokens": args.max_tokens,
                         "chunk_tokens": chunk_tokens, "prompts_per_call": args.prompts_per_call},
            "trainer": {"groups_per_step": args.groups, "max_staleness": max_staleness, "verify_fraction": 0.0,
                        "min_samplers": args.samplers},
            "nats": {"url": server.url, "replicas": len(nodes)},
        })
        config_path = Path(tmp) / "load.toml"
        config_path.write_text(cfg.to_toml())
        usage_file, trainer_log = Path(tmp) / "trainer-usage", Path(tmp) / "trainer.log"
        trainer = subprocess.Popen([sys.executable, "-m", "bench.load", "--role", "trainer", "--config", str(config_path),
                                    "--learner-us-per-token", str(args.learner_us_per_token),
                                    "--usage-file", str(usage_file), "--adapter-mb", str(args.adapter_mb)],
                                   stdout=subprocess.DEVNULL, stderr=trainer_log.open("wb"))  # a full pipe blocked it
        urls, sites = start_sites(nodes[0], args.relays, args.wan, Path(tmp) / "sites")
        urls = urls or [server.url]
        brokers = [psutil.Process(node.process.pid) for node in nodes]
        broker_peak, broker_cpu = [0], sum(sum(b.cpu_times()[:2]) for b in brokers)
        # The fleet in `processes` slices: this process runs the first, the others one each.
        share = -(-args.samplers // args.processes)
        slices = [(first, min(share, args.samplers - first)) for first in range(0, args.samplers, share)]
        others = [(subprocess.Popen([sys.executable, "-m", "bench.load", "--role", "samplers", "--config",
                                     str(config_path), "--usage-file", str(Path(tmp) / f"syncs-{first}"),
                                     "--first", str(first), "--count", str(count), "--urls", *urls,
                                     *_fleet_args(args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                   Path(tmp) / f"syncs-{first}") for first, count in slices[1:]]
        seen: dict = {}

        async def watch_broker():
            while True:
                broker_peak[0] = max(broker_peak[0], sum(b.memory_info().rss for b in brokers))
                await asyncio.sleep(0.5)

        async def main():
            watching = asyncio.create_task(watch_broker())
            try:
                return await samplers_role(cfg, speeds(args)[: slices[0][1]], args.median_tokens,
                                           lambda: trainer.poll() is None and _alive(others), urls, 0, args.churn,
                                           lambda run: registry_and_view(run, seen))
            finally:
                watching.cancel()

        started, began = time.perf_counter(), time.monotonic()
        try:
            syncs = asyncio.run(main())
            seen["hub_cpu_s"] = round(sum(sum(b.cpu_times()[:2]) for b in brokers) - broker_cpu, 1)
        finally:
            stop_processes([process for process, _ in others], timeout=180)
            stop_processes(sites)
        for _, file in others:
            syncs += orjson.loads(file.read_bytes())
        if trainer.wait() != 0:
            raise RuntimeError(f"the trainer failed: {trainer_log.read_text()[-3000:]}")
        metrics = read_metrics(cfg.run_dir)
        seen["trainer_warnings"] = warnings_by_event(trainer_log)
        if args.trainer_logs:  # the warnings' details (why a slot was released, after how long)
            Path(args.trainer_logs).mkdir(parents=True, exist_ok=True)
            shutil.copy(trainer_log, Path(args.trainer_logs) / f"trainer-{args.samplers}.log")
        return {**report(metrics, syncs, args, chunk_tokens, max_staleness, orjson.loads(usage_file.read_bytes()),
                         broker_peak[0], time.perf_counter() - started), **seen, "machine": MACHINE.report(since=began)}


def warnings_by_event(log: Path) -> dict[str, int]:
    """The trainer's warnings (and errors) in its log, counted by event: why slots were released,
    groups refused, samplers judged gone."""
    events = Counter()
    for line in log.read_bytes().splitlines():
        try:
            events[orjson.loads(line)["event"]] += 1
        except (orjson.JSONDecodeError, KeyError, TypeError):  # a traceback's lines, a library's print
            continue
    return dict(events.most_common())


def _alive(others: list) -> bool:
    """Every samplers process still running; one that ended says why."""
    for process, _ in others:
        if process.poll() is not None:
            raise RuntimeError(f"a samplers process exited with {process.returncode}: {process.stderr.read()[-3000:]}")
    return True


def _fleet_args(args) -> list[str]:
    """What a samplers process needs of the bench's arguments to draw its slice of the fleet."""
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("samplers", "median_tokens", "tokens_per_s",
                                                                      "slow_share", "slow_factor", "spread", "churn")]


def speeds(args) -> list[float]:
    """Each sampler's decoding speed: a heterogeneous fleet has `slow_share` of its samplers
    `slow_factor` times slower (a gaming GPU beside datacenter ones), whose calls outlast steps;
    with `spread` > 1 every sampler's speed is drawn log-uniformly down to spread times slower."""
    slow = round(args.slow_share * args.samplers)
    rng = random.Random(0)
    return [args.tokens_per_s / (args.slow_factor if i < slow else 1.0) / args.spread ** rng.random()
            for i in range(args.samplers)]


def wasted_share(metrics: list[dict]) -> float:
    """Of the tokens the steps read, those not trained: dropped as stale, older than the bound, or
    refused (every sampler here is honest: a group refused had its slot released before it came)."""
    wasted = sum(m["dropped_tokens"] + m["untrained_tokens"] + m["rejected_tokens"] for m in metrics)
    return round(wasted / max(1, wasted + sum(m["tokens"] for m in metrics)), 4)


def report(metrics: list[dict], syncs: list[float], args, chunk_tokens: int, max_staleness: int, trainer: dict,
           broker_peak: int, seconds: float) -> dict:
    later = metrics[1:] or metrics  # the first step waits for every sampler's first call
    learner, learner_all = sum(m["train_seconds"] for m in later), sum(m["train_seconds"] for m in metrics)
    overhead = sum(m["busy_seconds"] - m["train_seconds"] for m in later)  # checkpoint, publish, acks, accounting
    trained = sum(m["tokens"] for m in metrics)
    untrained = sum(m["untrained_tokens"] for m in metrics)
    dropped = sum(m["dropped_tokens"] for m in metrics)
    return {
        "samplers": args.samplers, "cluster": args.cluster, "relays": args.relays, "wan": args.wan, "groups_per_step": args.groups, "group_size": args.group_size,
        "max_new_tokens": args.max_tokens, "median_tokens": args.median_tokens, "tokens_per_s": args.tokens_per_s,
        "slow_share": args.slow_share, "slow_factor": args.slow_factor, "spread": args.spread, "churn": args.churn,
        "processes": args.processes, "adapter_mb": args.adapter_mb, "chunk_tokens": chunk_tokens,
        "max_staleness": max_staleness, "steps": len(metrics), "seconds": round(seconds, 1),
        "tokens_per_step": round(trained / len(metrics)),
        "learner_seconds_per_step": round(learner / len(later), 2),
        # the step's time after its groups are in, apart from the learner: publishing the
        # version, acks, accounting (fetching and scoring are in the wait, shared with generation)
        "overhead_share_of_learner": round(overhead / learner, 4) if learner else None,
        "overhead_share_by_phase": {phase: round(sum(m["phase_seconds"][phase] for m in later) / learner, 4)
                                    for phase in ("checkpoint", "publish", "account")} if learner else None,
        # after the first (the fleet joining): what a step takes, and the longest
        "step_s_median": round(float(np.median([m["step_seconds"] for m in later])), 2),
        "step_s_max": round(max(m["step_seconds"] for m in later), 2),
        "wait_share_of_step": round(sum(m["wait_seconds"] for m in later) / sum(m["step_seconds"] for m in later), 3),
        "wasted_token_share": wasted_share(metrics),
        # The run's second half: a sampler's first groups are granted before its pace is known,
        # and the slowest arrive stale (the joining's waste, once a run and a newcomer).
        "wasted_token_share_second_half": wasted_share(metrics[len(metrics) // 2:]),
        "wasted_token_share_by_step": [wasted_share([m]) for m in metrics],
        "dropped_stale_groups": sum(m["dropped_stale"] for m in metrics),
        # The trainer process's own CPU (its learner here sleeps): its broker work, comparable
        # across machines where the shares above depend on what else the cores run.
        "trainer_cpu_s_per_step": round(trainer["cpu_s"] / len(metrics), 2),
        # per token read (trained, or read and left out): what must not grow with the samplers
        "trainer_cpu_us_per_token": round(trainer["cpu_s"] / max(1, trained + untrained + dropped) * 1e6, 3),
        # the same after the first step: the steady cost, the fleet's joining left out
        "trainer_cpu_us_per_token_after_first_step": None if trainer["after_first_step_cpu_s"] is None else round(
            trainer["after_first_step_cpu_s"] / max(1, sum(m["tokens"] + m["untrained_tokens"] + m["dropped_tokens"]
                                                           for m in metrics[1:])) * 1e6, 3),
        "granter_ms_per_step": {k: round(v / len(metrics) * 1e3, 1) for k, v in trainer.get("granter_s", {}).items()
                                if not k.endswith("_calls")},
        "grant_requests_per_step": round(trainer.get("granter_s", {}).get("grant_calls", 0) / len(metrics), 1),
        # after the first (the fleet joining: every ask is told to wait, `trainer.min_samplers`)
        "grant_answers_per_step": {k: round(v / max(1, len(metrics) - 1), 1)
                                   for k, v in trainer["grant_outcomes_after_first_step"].items()},
        "accounting": metrics[-1]["accounting"],  # nothing lost: published = trained + dropped + rejected + pending
        "rejected_by": dict(sum((Counter(m.get("rejected") or {}) for m in metrics), Counter())),
        "counted_twice": sum(m["already_counted"] for m in metrics),
        "trainer_cpu_share_of_learner": round(trainer["cpu_s"] / learner_all, 4) if learner_all else None,
        "trainer_peak_gb": round(trainer["peak"] / 2**30, 3), "broker_peak_gb": round(broker_peak / 2**30, 3),
        "sync_s_median": round(float(np.median(syncs)), 3) if syncs else None,
        "sync_s_max": round(max(syncs), 3) if syncs else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["bench", "trainer", "samplers"], default="bench")
    p.add_argument("--config", type=Path)
    p.add_argument("--usage-file", type=Path)
    p.add_argument("--samplers", type=int, nargs="+", default=[8])
    p.add_argument("--groups", type=int, default=64, help="groups a step")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--median-tokens", type=int, default=4096)
    p.add_argument("--prompts-per-call", type=int, default=2)
    p.add_argument("--tokens-per-s", type=float, default=2000.0, help="a sampler's decoding speed, each row of its batch")
    p.add_argument("--slow-share", type=float, default=0.0, help="the share of samplers that decode slower")
    p.add_argument("--slow-factor", type=float, default=1.0, help="how many times slower they decode")
    p.add_argument("--learner-us-per-token", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--staleness", type=int, nargs="+", default=[1])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 1024], help="chunk_tokens: 0 is whole completions")
    p.add_argument("--cluster", type=int, default=1, help="hub nodes: a cluster of 3 keeps 3 copies of everything")
    p.add_argument("--relays", type=int, default=0, help="sites, each a relay its samplers reach the run through")
    p.add_argument("--wan", nargs=2, type=float, metavar=("RTT_MS", "MBIT"), help="each site's link to the hub")
    p.add_argument("--spread", type=float, default=1.0,
                   help="speeds drawn log-uniformly down to this many times slower")
    p.add_argument("--churn", type=float, default=0.0, help="the share of samplers that die once and come back")
    p.add_argument("--processes", type=int, default=1, help="processes the samplers are spread over")
    p.add_argument("--adapter-mb", type=float, default=ADAPTER_MB, help="the stand-in adapter's size")
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)  # --role samplers: its slice
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--urls", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--out", default="load.json")
    p.add_argument("--trainer-logs", help="keep each shape's trainer log in this folder (JSON lines)")
    p.add_argument("--plot", help="also draw each figure against the number of samplers into bench/results/PLOT")
    args = p.parse_args()
    if args.role == "trainer":
        asyncio.run(trainer_role(load_config(args.config), args.learner_us_per_token * 1e-6, args.usage_file,
                                 args.adapter_mb))
        return
    if args.role == "samplers":
        samplers_process(args)
        return
    results = []
    for samplers in args.samplers:
        for max_staleness in args.staleness:
            for chunk_tokens in args.chunks:
                results.append(run_shape(argparse.Namespace(**{**vars(args), "samplers": samplers}), chunk_tokens,
                                         max_staleness))
                print(orjson.dumps(results[-1]).decode(), flush=True)
    existing = results_dir() / args.out  # shapes measured before stay, unless measured again now
    earlier = orjson.loads(existing.read_bytes())["shapes"] if existing.exists() else []
    measured = {_shape(r) for r in results}
    print(write_results(args.out, {"shapes": [r for r in earlier if _shape(r) not in measured] + results}))
    if args.plot:
        plot_by_samplers(results, results_dir() / args.plot)


SCALE_FIGURES = [("trainer_cpu_us_per_token", "trainer CPU, us a token read (all; after step 1)"),
                 ("granter_ms_per_step", "granter, ms a step (grants; heartbeats)"),
                 ("hub_cpu_s", "hub CPU, s"), ("snapshot_s", "status snapshot, s"),
                 ("wasted_token_share", "tokens wasted, share"), ("sync_s_median", "weights to running, s (p50; max)")]


def plot_by_samplers(results: list[dict], out: Path) -> None:
    """Each scale figure against the number of samplers (log axis), one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: r["samplers"])
    samplers = [r["samplers"] for r in results]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, SCALE_FIGURES):
        if key == "granter_ms_per_step":
            for part in ("grant", "read_heartbeats"):
                ax.plot(samplers, [r[key].get(part, 0) for r in results], marker="o", label=part)
            ax.legend()
        else:
            ax.plot(samplers, [r[key] for r in results], marker="o")
            dashed = {"sync_s_median": "sync_s_max",
                      "trainer_cpu_us_per_token": "trainer_cpu_us_per_token_after_first_step"}
            if key in dashed:  # the fleet's joining is in step 1
                ax.plot(samplers, [r[dashed[key]] for r in results], marker="o", linestyle="--")
        ax.set_xscale("log")
        ax.set_xticks(samplers, [str(s) for s in samplers])
        ax.set_title(title)
        ax.set_xlabel("samplers")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def _shape(result: dict) -> tuple:
    return tuple(str(result.get(k)) for k in ("samplers", "relays", "wan", "groups_per_step", "group_size",
                                              "max_new_tokens", "median_tokens", "tokens_per_s", "slow_share",
                                              "slow_factor", "spread", "churn", "chunk_tokens", "max_staleness"))


if __name__ == "__main__":
    main()
