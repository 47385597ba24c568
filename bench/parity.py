"""Benchmark: does decoupling match co-located training? Echo's claim, measured.

Five modes on the same model, task, seeds, batch sizes and optimizer, the same number of steps:
co-located (bench/colocated.py: generate, then train, in one process), sequential (the swarm,
samplers refreshed before every step), and async at staleness S = 1, 2, 4 (the swarm, samplers
generating while the trainer trains). Each mode runs once per seed. After every run, one engine
scores the base model and each run's final weights on the task's held-out prompts, greedy.

Per mode: held-out score (mean and spread over seeds), reward vs step and vs wall-clock (one PNG),
learner busy, sampler busy (the samplers' generating time over their wall time), seconds per
step, and completion tokens wasted on groups dropped as stale. The verdict compares each async
mode with sequential and co-located: "within noise" when an exact permutation test over seeds
finds the gap in mean held-out score unremarkable (p >= 0.05). Not a gap against the standard
error: on a task where a seed either takes off or does not by the last step, the scores are
bimodal and three seeds that all failed have no spread at all.

    .venv/bin/python -m bench.parity --preset quick   # the tiny model: checks the pipeline (< 15 min)
    .venv/bin/python -m bench.parity --preset full    # SmolLM2-135M: the parity numbers
    .venv/bin/python -m bench.parity --preset full --add --modes colocated --first-seed 3  # more seeds
    .venv/bin/python -m bench.parity --preset full --report  # the table, verdict and PNG again

Writes bench/results/parity-<preset>.json and parity-<preset>.png.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

from bench.common import results_dir
from echo.checkpoint import latest_weights, read_metrics, read_shards
from echo.config import EchoConfig, apply_override, validate_config
from echo.devices import resolve_device
from echo.engines import make_engine
from echo.tasks import load_task
from workers.evaluate import held_out_score

MODES = {
    "colocated": {},
    "sequential": {"run": {"mode": "sequential"}},
    "async S=1": {"trainer": {"max_staleness": 1}},
    "async S=2": {"trainer": {"max_staleness": 2}},
    "async S=4": {"trainer": {"max_staleness": 4}},
}
# Level-1 sums and differences up to 50: ~5,000 problems, a tenth of them held out.
TASK = {"name": "math", "params": {"levels": [1], "max_operand": 50}}
PRESETS = {
    "quick": {"model": "tiny", "note": "the tiny random model scores 0 in a few steps: this run checks the "
              "pipeline and measures the modes' pace and waste, not their rewards", "steps": 12, "seeds": 3, "eval_prompts": 200, "parallel": 1,
              "sampling": {"group_size": 4, "max_new_tokens": 12}, "trainer": {"groups_per_step": 4, "lr": 1e-3},
              "lora": {"r": 4, "alpha": 8.0}},
    "full": {"model": "smollm2", "note": "", "steps": 40, "seeds": 3, "eval_prompts": 400, "parallel": 3,
             "sampling": {"group_size": 8, "max_new_tokens": 32}, "trainer": {"groups_per_step": 8, "lr": 2e-4},
             "lora": {}},
}


def run_config(preset: dict, mode: str, seed: int, runs_dir: Path, overrides: list[str] = ()) -> EchoConfig:
    slug = mode.replace(" ", "-").replace("=", "")
    sections = {
        "run": {"id": f"{slug}-seed{seed}", "dir": str(runs_dir), "steps": preset["steps"], "seed": seed,
                "eval_prompts": 0},
        "model": {"name": preset["model"]},
        "task": TASK,
        "lora": preset["lora"],
        "sampling": preset["sampling"],
        "trainer": {**preset["trainer"], "verify_fraction": 0.0},  # the proof of sampling costs every mode alike
        "sampler": {"count": 2},
    }
    for section, values in MODES[mode].items():
        sections[section] = {**sections.get(section, {}), **values}
    for assignment in overrides:
        apply_override(sections, assignment)
    return validate_config(sections)


def run_one(cfg: EchoConfig, mode: str, log_dir: Path) -> Path:
    """One run in its own processes: `echo-rl up`, or the co-located baseline."""
    config_path = log_dir / f"{cfg.run.id}.toml"
    config_path.write_text(cfg.to_toml())
    command = ([sys.executable, "-m", "bench.colocated", "--config", str(config_path)] if mode == "colocated"
               else [sys.executable, "-m", "workers.cli", "up", "--config", str(config_path), "--log-json"])
    with open(log_dir / f"{cfg.run.id}.log", "wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{cfg.run.id} failed ({done.returncode}): see {log_dir / cfg.run.id}.log")
    return cfg.run_dir


def run_summary(cfg: EchoConfig, mode: str) -> dict:
    lines = read_metrics(cfg.run_dir)
    wall = lines[-1]["wall_seconds"]
    # One process does both in the co-located run: its "sampler" is the same device, part time.
    sampler_count = 1 if mode == "colocated" else cfg.sampler.count
    trained = sum(r["tokens"] for r in lines)
    wasted = sum(r["dropped_tokens"] for r in lines)
    return {
        "seed": cfg.run.seed,
        "reward": [r["reward_mean"] for r in lines],
        "wall_seconds": [r["wall_seconds"] for r in lines],
        "seconds_per_step": wall / len(lines),
        "learner_busy": sum(r["busy_seconds"] for r in lines) / wall,
        "sampler_busy": sum(r["generated_seconds"] for r in lines) / (sampler_count * wall),
        "wasted_token_fraction": wasted / max(trained + wasted, 1),
        "dropped_groups": sum(r["dropped_stale"] for r in lines),
    }


class HeldOut:
    """One engine that scores the base model once, then each run's final weights, greedy."""

    def __init__(self, cfg: EchoConfig, n: int):
        self.engine, self.task = make_engine(cfg), load_task(cfg.task)
        self.prompts = self.task.held_out(n)
        self.batch = 64 if resolve_device(cfg.model.device).type == "cuda" else 16
        self.max_tokens = cfg.sampling.max_new_tokens
        reward, correct = self.score()  # the engine starts as the base model
        self.base = {"prompts": len(self.prompts), "reward": reward, "correct": correct}

    def score(self) -> tuple[float, float]:
        return held_out_score(self.engine, self.task, self.prompts, self.max_tokens, self.batch)

    def score_run(self, run_dir: Path) -> tuple[float, float]:
        self.engine.load_weights(read_shards(latest_weights(run_dir)[1]))
        return self.score()


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def permutation_p(a: list[float], b: list[float], resamples: int = 100_000) -> float:
    """Two-sided p-value of the gap in means between `a` and `b`: the share of ways to deal the
    pooled values into groups of their sizes whose gap is at least as large. Every way when
    there are at most `resamples` of them, else that many random deals (seeded)."""
    pooled, n = a + b, len(b)
    observed = abs(statistics.fmean(b) - statistics.fmean(a)) - 1e-12
    total = sum(pooled)

    def gap(picked: tuple[int, ...]) -> float:
        b_sum = sum(pooled[i] for i in picked)
        return abs(b_sum / n - (total - b_sum) / len(a))

    if math.comb(len(pooled), n) <= resamples:
        deals = list(itertools.combinations(range(len(pooled)), n))
    else:
        rng = random.Random(0)
        deals = [tuple(rng.sample(range(len(pooled)), n)) for _ in range(resamples)]
    return sum(gap(d) >= observed for d in deals) / len(deals)


def verdict(modes: dict, reference: str, other: str) -> dict:
    """Is `other`'s mean held-out score within noise of `reference`'s (a permutation test over
    seeds, p >= 0.05), and how much faster per wall-clock second is it?"""
    a, b = modes[reference]["held_out_correct"]["values"], modes[other]["held_out_correct"]["values"]
    gap = statistics.fmean(b) - statistics.fmean(a)
    p = permutation_p(a, b)
    # Every score the same (e.g. the tiny model scoring 0 everywhere): nothing to judge.
    within = None if len(set(a + b)) == 1 else p >= 0.05
    return {"gap": round(gap, 4), "p_value": round(p, 4), "within_noise": within,
            "speed_vs_reference": round(modes[reference]["seconds_per_step"]["mean"]
                                        / modes[other]["seconds_per_step"]["mean"], 3)}


def verdicts(modes: dict) -> dict:
    return {f"{other} vs {reference}": verdict(modes, reference, other)
            for reference in ("sequential", "colocated") if reference in modes
            for other in modes if other.startswith("async")}


def add_to(path: Path, results: dict) -> dict:
    """The modes already in `path`, measured the same way (a device lends 10 minutes a call)."""
    earlier = orjson.loads(path.read_bytes())
    for key in ("preset", "model", "steps", "task", "machine"):  # not the note
        if earlier[key] != results[key]:
            raise SystemExit(f"--add: {path} has {key} {earlier[key]!r}, this run {results[key]!r}")
    return earlier


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, m in results["modes"].items():
        runs = m["runs"]
        steps = range(1, min(len(r["reward"]) for r in runs) + 1)
        rewards = [[r["reward"][i - 1] for r in runs] for i in steps]
        mean = [statistics.fmean(x) for x in rewards]
        line, = by_step.plot(steps, mean, label=mode)
        by_step.fill_between(steps, [min(x) for x in rewards], [max(x) for x in rewards], alpha=0.15,
                             color=line.get_color())
        seconds = [statistics.fmean(r["wall_seconds"][i - 1] for r in runs) for i in steps]
        by_time.plot(seconds, mean, label=mode, color=line.get_color())
        by_time.fill_between(seconds, [min(x) for x in rewards], [max(x) for x in rewards], alpha=0.15,
                             color=line.get_color())
    by_step.set(xlabel="step", ylabel="training reward (mean over seeds, band: min-max)")
    by_time.set(xlabel="wall-clock seconds (mean over seeds)", ylabel="training reward")
    by_step.legend()
    seeds = sorted({len(m["runs"]) for m in results["modes"].values()})
    fig.suptitle(f"{results['model']}: {'-'.join(map(str, seeds))} seeds x {results['steps']} steps, {results['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--seeds", type=int, help="runs per mode (the preset's by default)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1 "
                        "(with --add, a mode's new seeds join its earlier runs)")
    parser.add_argument("--parallel", type=int, help="runs at once (the seeds of a mode run together)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="every run's config")
    parser.add_argument("--work-dir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--add", action="store_true", help="keep the other modes already in the results file")
    parser.add_argument("--report", action="store_true", help="run nothing: the verdict, table and PNG again "
                        "from the results file")
    parser.add_argument("--out", default=str(results_dir()))
    args = parser.parse_args()
    path = Path(args.out) / f"parity-{args.preset}.json"
    if args.report:
        return report(path)
    preset = dict(PRESETS[args.preset], **{k: v for k, v in (("seeds", args.seeds), ("parallel", args.parallel)) if v})
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {list(MODES)}")

    path.parent.mkdir(parents=True, exist_ok=True)
    seeds = range(args.first_seed, args.first_seed + preset["seeds"])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        results = {"preset": args.preset, "model": preset["model"], "steps": preset["steps"],
                   "seeds": preset["seeds"], "task": TASK, "machine": machine(), "note": preset["note"], "modes": {}}
        if args.add:
            results = add_to(path, results)
        started, held_out, earlier_seconds = time.monotonic(), None, results.get("seconds", 0)
        for mode in modes:
            earlier_runs = results["modes"].get(mode, {}).get("runs", [])
            if repeated := sorted({r["seed"] for r in earlier_runs} & set(seeds)):
                parser.error(f"{mode}: seeds {repeated} already in the results (--first-seed)")
            configs = [run_config(preset, mode, seed, work / "runs", args.set) for seed in seeds]
            with ThreadPoolExecutor(preset["parallel"]) as pool:
                run_dirs = list(pool.map(lambda c: run_one(c, mode, work / "logs"), configs))
            held_out = held_out or HeldOut(configs[0], preset["eval_prompts"])
            results["base"] = held_out.base
            runs = [run_summary(c, mode) for c in configs]
            for run, run_dir in zip(runs, run_dirs):
                run["held_out_reward"], run["held_out_correct"] = held_out.score_run(run_dir)
                run["overrides"] = args.set  # seeds added later may have run with others
            runs = earlier_runs + runs
            results["modes"][mode] = {"runs": runs, **{key: _spread([r[key] for r in runs]) for key in (
                "held_out_reward", "held_out_correct", "seconds_per_step", "learner_busy", "sampler_busy",
                "wasted_token_fraction")}}
            results["seconds"] = earlier_seconds + round(time.monotonic() - started)
            # After each mode: a run cut short keeps what it measured.
            write(results, path)
            print(mode, f"{results['seconds']} s", flush=True)
    show(results, path)


def write(results: dict, path: Path) -> None:
    results["modes"] = {mode: results["modes"][mode] for mode in MODES if mode in results["modes"]}
    results["verdict"] = verdicts(results["modes"])
    path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))


def report(path: Path) -> None:
    """The results file's verdict computed again (as this code judges), its PNG and table."""
    results = orjson.loads(path.read_bytes())
    write(results, path)
    show(results, path)


def show(results: dict, path: Path) -> None:
    plot(results, path.with_suffix(".png"))
    print(table(results))


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return f"{gpu}, {os.cpu_count()} CPU cores" if gpu else f"{os.cpu_count()} CPU cores, no GPU"


def table(results: dict) -> str:
    rows = ["| mode | seeds | held-out correct | held-out reward | s/step | learner busy | sampler busy | tokens wasted |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, m in results["modes"].items():
        rows.append(f"| {mode} | {len(m['runs'])} | {m['held_out_correct']['mean']:.3f} ± {m['held_out_correct']['std']:.3f} "
                    f"| {m['held_out_reward']['mean']:.3f} | {m['seconds_per_step']['mean']:.2f} "
                    f"| {m['learner_busy']['mean']:.2f} | {m['sampler_busy']['mean']:.2f} "
                    f"| {m['wasted_token_fraction']['mean']:.3f} |")
    base = results["base"]
    rows.append(f"\nbase model: correct {base['correct']:.3f}, reward {base['reward']:.3f} on {base['prompts']} prompts")
    judged = {True: "within noise", False: "NOT within noise", None: "no signal to judge"}
    rows += [f"{name}: gap {v['gap']:+.4f} (p = {v['p_value']:.3f}) -> "
             f"{judged[v['within_noise']]}; {v['speed_vs_reference']:.2f}x the steps per second"
             for name, v in results["verdict"].items()]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
