"""Benchmark: the capacity model (echo/fleet/capacity.py) against the real swarm, and what cost-aware
activation saves. Each fleet is a real trainer and real samplers on the tiny model, joined by a
nats-server, the samplers slowed to different speeds (`sampler.throttle_s`, a pause per group)
and given costs (`sampler.cost_per_hour`). After the run the model predicts the learner's
utilisation from what was measured over the second half of the run, reading by reading (each
second: the active samplers' rates and sync times as their heartbeats said them then, the
learner's pace in the step it was taking) and is compared with the utilisation the trainer
measured over the same steps (busy / (busy + waiting for groups)). Cost per step: the active samplers' cost per hour
times the measured seconds per step.

    .venv/bin/python -m bench.scheduling [--steps 24]

Writes bench/results/scheduling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import orjson

from bench.common import write_results
from echo.config import validate_config
from echo.fleet.capacity import LearnerPace, sampler_pace, utilisation
from echo.train.metrics import read_metrics
from echo.wire.messages import SamplerStatus
from streams.client import open_run
from streams.registry import read_statuses, read_trainer_status
from streams.server import NatsServer
from workers.operator.swarm import stop_processes, worker_command


@dataclass(frozen=True)
class FleetSampler:
    id: str
    throttle_s: float  # seconds per group on top of generating it
    cost_per_hour: float


FLEETS = {
    "two fast": [FleetSampler("s1", 0.05, 1.0), FleetSampler("s2", 0.05, 1.0)],
    "one slow": [FleetSampler("s1", 0.6, 1.0)],
    "fast and slow": [FleetSampler("s1", 0.25, 2.0), FleetSampler("s2", 0.8, 0.5)],
}
# Where activation matters: two cheap samplers keep the learner 80% busy, a dear one adds little.
ACTIVATION_FLEET = [FleetSampler("s1", 0.05, 1.0), FleetSampler("s2", 0.05, 1.0), FleetSampler("s3", 0.05, 6.0)]
ACTIVATION_TARGET = 0.8


def fleet_config(run_dir: Path, run_id: str, steps: int, scheduler: bool, target: float, step_throttle_s: float):
    return validate_config({
        "run": {"id": run_id, "dir": str(run_dir), "steps": steps},
        "model": {"name": "tiny"},
        "lora": {"r": 4, "alpha": 8.0},
        "sampling": {"group_size": 4, "max_new_tokens": 8, "prompts_per_call": 2},
        "trainer": {"groups_per_step": 4, "max_staleness": 1, "threads": 1, "throttle_s": step_throttle_s},
        # Rates over the last few seconds (the default minute is longer than these runs): what
        # the heartbeats say then follows a load that changes, and their readings over the
        # measured steps describe those steps.
        "sampler": {"threads": 1, "heartbeat_s": 0.5, "entry_ttl_s": 3, "rate_window_s": 3.0},
        "scheduler": {"enabled": scheduler, "target_utilisation": target, "every_s": 1.0},
    })


async def _registry(url: str, run_id: str):
    run = await open_run(url, run_id, "bench", create=False)
    try:
        return await read_trainer_status(run), await read_statuses(run)
    finally:
        await run.close()


async def _follow(trainer: subprocess.Popen, url: str, run_id: str, run_dir: Path,
                  timeout: float) -> list[tuple[int, list[SamplerStatus]]]:
    """Until the trainer exits (TimeoutError after `timeout`): every second, the steps it has
    finished and the registry's statuses then."""
    samples = []
    async with asyncio.timeout(timeout):
        run = await open_run(url, run_id, "bench", create=False)
        try:
            while trainer.poll() is None:
                samples.append((len(read_metrics(run_dir)), await read_statuses(run)))
                await asyncio.sleep(1.0)
        finally:
            await run.close()
    return samples


def predicted_utilisation(window: list[tuple[int, list[SamplerStatus]]], metrics: list[dict],
                          groups_per_step: int, max_staleness: int) -> float:
    """The capacity model's utilisation over `window` (registry readings a second apart, each
    with the steps finished then): at each reading, the model's for the learner's pace in the
    step it was taking and the rates the active samplers' heartbeats said; then averaged over the
    readings, as the measured utilisation is busy time over all time. Under a load that changes
    mid-run the rates and the learner's pace change together, and the model is nonlinear in
    them: its value at their means (what this once computed) is not the mean of its values."""
    predictions = []
    for finished, beats in window:
        learner = LearnerPace(metrics[finished]["busy_seconds"], groups_per_step, max_staleness)
        paces = [sampler_pace(s) for s in beats if s.state == "active" and s.groups_per_s > 0]
        predictions.append(utilisation(learner, paces) if paces else 0.0)
    return mean(predictions)


def run_fleet(work_dir: Path, samplers: list[FleetSampler], steps: int, scheduler: bool = False,
              target: float = 0.9, step_throttle_s: float = 0.0, timeout: float = 240) -> dict:
    """One run of a fleet: measured utilisation and cost per step, and the model's prediction.
    `step_throttle_s` slows the learner (trainer.throttle_s)."""
    run_id = "fleet"
    work_dir.mkdir(parents=True, exist_ok=True)
    cfg = fleet_config(work_dir / "runs", run_id, steps, scheduler, target, step_throttle_s)
    config_path = work_dir / "config.toml"
    config_path.write_text(cfg.to_toml())
    with NatsServer(work_dir / "nats") as server:
        common = ["--config", str(config_path), "--nats", server.url, "--log-json"]
        trainer = subprocess.Popen(worker_command(["trainer", *common]), stderr=subprocess.PIPE, text=True)
        workers = [subprocess.Popen(worker_command(
            ["sampler", *common, "--id", s.id, "--set", f"sampler.throttle_s={s.throttle_s}",
             "--set", f"sampler.cost_per_hour={s.cost_per_hour}"]), stderr=subprocess.DEVNULL) for s in samplers]
        log_parts: list[str] = []
        reader = threading.Thread(target=lambda: log_parts.append(trainer.stderr.read()), daemon=True)
        reader.start()
        try:
            try:
                samples = asyncio.run(_follow(trainer, server.url, run_id, cfg.run_dir, timeout))
            except TimeoutError:
                trainer.kill()
                reader.join()
                raise RuntimeError(f"the run did not finish in {timeout} s: {''.join(log_parts)[-3000:]}") from None
            reader.join()
            logs = "".join(log_parts)
            if trainer.wait() != 0:
                raise RuntimeError(f"the trainer failed: {logs[-2000:]}")
            pace, statuses = asyncio.run(_registry(server.url, run_id))
        finally:
            stop_processes([trainer, *workers])
    metrics = read_metrics(cfg.run_dir)
    later = metrics[len(metrics) // 2:]
    # The samplers' rates over the same steps as the learner's measured utilisation: a machine
    # whose load changes during the run changes the rates, and the last heartbeat's window alone
    # would describe another stretch of the run than the one measured.
    # (Readings once the last step is done are left out: the samplers then say the run finished.)
    window = ([(steps, beats) for steps, beats in samples if len(metrics) // 2 <= steps < len(metrics)]
              or [(steps, beats) for steps, beats in samples if steps < len(metrics)][-1:])  # a run shorter than a reading
    busy, wait = sum(m["busy_seconds"] for m in later), sum(m["wait_seconds"] for m in later)
    choices = [event for event in map(_json_line, logs.splitlines()) if event.get("event") == "scheduler.chose"]
    # The scheduler's last choice, not the samplers' own states: once the trainer says the run
    # has finished, they say "finished".
    standby = choices[-1]["standby"] if choices else []
    active = [s for s in statuses if s.sampler_id not in standby and s.state != "quarantined"]
    costs = {s.id: s.cost_per_hour for s in samplers}
    seconds_per_step = (busy + wait) / len(later)
    hourly = sum(costs[s.sampler_id] for s in active)
    # T over the same steps as the measured utilisation (the trainer's own pace covers its last 10).
    learner = LearnerPace(busy / len(later), pace.groups_per_step, pace.max_staleness)
    return {
        "samplers": [vars(s) for s in samplers],
        "scheduler": scheduler,
        "active": sorted(s.sampler_id for s in active),
        "standby": sorted(standby),
        "measured": {s.sampler_id: {"groups_per_s": s.groups_per_s, "call_s": s.call_s,
                                    "sync_s": round(sum(s.sync_s.values()) / max(len(s.sync_s), 1), 4)}
                     for s in statuses},
        "step_s": round(learner.step_s, 3),
        "predicted_utilisation": round(predicted_utilisation(window, metrics, pace.groups_per_step,
                                                             pace.max_staleness), 3),
        "measured_utilisation": round(busy / (busy + wait), 3),
        "seconds_per_step": round(seconds_per_step, 3),
        "cost_per_hour": hourly,
        "cost_per_step": round(hourly * seconds_per_step / 3600, 6),
        "groups_by_sampler_second_half": {s.id: sum(g[2] == s.id for m in later for g in m["groups"]) for s in samplers},
        "samplers_by_step": {m["step"]: [g[2] for g in m["groups"]] for m in metrics},
        "choices": choices,
    }


def _json_line(line: str) -> dict:
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError:  # a line not from the logger
        return {}
    return event if isinstance(event, dict) else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    results = {"machine": f"{os.cpu_count()} CPU cores", "model": "tiny", "steps": args.steps, "fleets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (name, fleet) in enumerate(FLEETS.items()):
            results["fleets"][name] = run_fleet(Path(tmp) / f"f{n}", fleet, args.steps)
            print(name, results["fleets"][name], flush=True)
        started = time.monotonic()
        on = run_fleet(Path(tmp) / "on", ACTIVATION_FLEET, args.steps, scheduler=True, target=ACTIVATION_TARGET)
        off = run_fleet(Path(tmp) / "off", ACTIVATION_FLEET, args.steps, scheduler=False)
        results["activation"] = {"on": on, "off": off,
                                 "cost_per_step_on_vs_off": round(on["cost_per_step"] / off["cost_per_step"], 3),
                                 "seconds": round(time.monotonic() - started)}
    out = write_results("scheduling.json", results)
    print(out.read_text())


if __name__ == "__main__":
    main()
