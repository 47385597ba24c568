"""Benchmark: does decoupling match co-located training? Echo's claim, measured with power.

Five modes on the same model, task, batch sizes and optimizer, the same number of steps:
co-located (bench/colocated.py: generate, then train, in one process), sequential (the swarm,
samplers refreshed before every step), and async at staleness S = 1, 2, 4 (the swarm, samplers
generating while the trainer trains). Runs are interleaved: seed by seed, each seed's modes in
an order rotated from the last seed's, so no stretch of the machine's time or version of the code
goes with one mode (every run records the commit it ran and when it started).

The task measures skill from step 0: reasoning-gym's lcm with a solved problem shown first, so
SmolLM2 answers in the format from the start and scores about 0.2 held out, where no constant
answer scores above 0.07 (bench/results/gym_base.json). After each run one engine scores its
weights every `eval_every` steps on the held-out problems, greedy: a held-out curve per run. For each async mode against
sequential and co-located the verdict compares
- the final held-out accuracy and the area under the held-out curve: a permutation test over
  seeds (exact when the deals can be counted), which assumes no shape of the noise;
- the steps to reach `threshold` held-out accuracy: a log-rank test, runs that never reach it
  censored at the last step;
and it is "within noise" when none of the three finds a gap (p >= 0.05). Cost: dollars per point
of held-out accuracy gained (over the base model), from the runs' busy times at stated hourly
prices: the learner's training time at the trainer's price, the samplers' generating time at the
sampler's (the co-located run's one device, its whole wall time at the trainer's). Every run
keeps its per-step metrics: importance ratios, clip fraction, KL, grad norm, staleness, groups
dropped and rejected, reward mismatches, proof-of-sampling results.

    .venv/bin/python -m bench.parity --preset quick   # the tiny model: checks the pipeline (minutes)
    .venv/bin/python -m bench.parity --preset study   # SmolLM2, 10 seeds a mode (a GPU: bench/gpu/parity.sh)
    .venv/bin/python -m bench.parity --preset study --add --first-seed 10 --seeds 2   # more seeds
    .venv/bin/python -m bench.parity --preset study --report   # verdict, table and PNG again
    .venv/bin/python -m bench.parity --preset controlled       # the staleness study: tiny model, ~1 hour
    .venv/bin/python -m bench.parity --preset study-cpu --resume --commit   # SmolLM2 across sessions
    .venv/bin/python -m bench.parity --preset study-cpu --resume --commit --modes "colocated,async S=1"  # those first

Writes bench/results/parity-<preset>.json and parity-<preset>.png. (parity-full.json is the
earlier study: 21 runs on the math task, which SmolLM2 starts at 0.013.)
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

from bench.common import MACHINE, results_dir
from echo.config import EchoConfig, apply_override, validate_config
from echo.engines import make_engine
from echo.model.devices import resolve_device
from echo.tasks import load_task
from echo.train.heldout import held_out_score
from echo.train.metrics import read_metrics
from echo.weights.files import read_shards, weights_at

MODES = {
    # The peer: TRL's GRPOTrainer on the same work (bench/peer_trl.py; the `peer-trl` preset).
    "trl": {},
    "colocated": {},
    "sequential": {"run": {"mode": "sequential"}},
    "async S=1": {"trainer": {"max_staleness": 1}},
    "async S=2": {"trainer": {"max_staleness": 2}},
    "async S=4": {"trainer": {"max_staleness": 4}},
    "async S=8": {"trainer": {"max_staleness": 8}},
    # The known answer a study with power finds (AReaL's): uncorrected, staleness costs learning.
    "async S=8 no IS": {"trainer": {"max_staleness": 8}, "algorithm": {"rollout_is": "off"}},
    # Several updates a batch (PPO-style, as ECHO-2 and AReaL run): pi_old moves off the
    # samplers' mu by four updates a step, on top of the staleness. Does that cost more, and does
    # IcePop's two-sided token mask (with the weights inside its band) hold it?
    "async S=4 x4": {"trainer": {"max_staleness": 4}, "algorithm": {"num_iterations": 4}},
    "async S=4 x4 IcePop": {"trainer": {"max_staleness": 4},
                            "algorithm": {"num_iterations": 4, "rollout_is": "token", "rollout_is_threshold": 5.0,
                                          "rollout_rs": "token", "rollout_rs_threshold": 5.0,
                                          "rollout_rs_threshold_lower": 0.5}},
}
FIVE = ["colocated", "sequential", "async S=1", "async S=2", "async S=4"]
ONE_PROCESS = ("colocated", "trl")  # generating and training in turn, on one device
# Where a run's held-out curve points keep each measure: [step, correct, reward].
MEASURES = {"correct": 1, "reward": 2}
# lcm of two numbers up to 20: SmolLM2 starts at 0.19 held out, where the best constant answer
# gets 0.06 (bench/gym_base.py). Not gcd: "1" is the answer to 0.56 of its held-out problems, and
# a run learned to give one answer to all (docs/performance.md).
TASK = {"name": "reasoning_gym:lcm", "params": {"max_value": 20}}
PRESETS = {
    "quick": {"model": "tiny", "task": TASK, "modes": FIVE, "measure": "correct",
              "note": "the tiny random model scores ~0: this run checks the pipeline and the modes' pace, not their "
              "rewards", "steps": 6, "seeds": 2, "eval_every": 3, "eval_prompts": 40,
              "threshold": 0.5, "parallel": 1, "sampling": {"group_size": 4, "max_new_tokens": 12},
              "trainer": {"groups_per_step": 4, "lr": 1e-3}, "lora": {"r": 4, "alpha": 8.0}},
    "study": {"model": "smollm2", "task": TASK, "modes": FIVE, "measure": "correct", "note": "", "steps": 60,
              "seeds": 10, "eval_every": 10, "eval_prompts": 160,
              "threshold": 0.4, "parallel": 5, "sampling": {"group_size": 8, "max_new_tokens": 32},
              "trainer": {"groups_per_step": 8, "lr": 2e-4}, "lora": {}},
    # The study shortened to 12-16 minutes a run on an idle 2-core CPU box (more with work beside
    # it), to run across sessions (--resume --commit): half the steps and half the groups a step
    # at twice the learning rate, three modes. A quarter of the study's samples: on the CPU the
    # study's own run rose from 0.19 only after step 30 (bench/results/pilot-lcm), so this one can
    # tell a run that collapses or stalls from one that learns, not the few points the full study could.
    "study-cpu": {"model": "smollm2", "task": TASK, "modes": ["colocated", "async S=1", "sequential"],
                  "measure": "correct", "note": "the study shortened for a 2-core CPU box", "steps": 30, "seeds": 10,
                  "eval_every": 10, "eval_prompts": 160, "threshold": 0.3, "parallel": 1,
                  "sampling": {"group_size": 8, "max_new_tokens": 32},
                  "trainer": {"groups_per_step": 4, "lr": 4e-4}, "lora": {}},
    # The controlled study (about an hour here): the tiny model, full weights, on a task it learns
    # from step 0 with partial credit (bench/letters.py: its samples' reward from ~0.1 to ~0.9 in
    # 40 co-located steps), judged on the held-out reward of 8 samples a prompt (a greedy answer
    # saturates within a few steps). A learning rate high enough that 8 versions apart are far
    # apart: at S = 8 nearly every group trained is 8 versions old.
    "controlled": {"model": "tiny", "task": {"name": "bench.letters:Letters", "params": {}},
                   "modes": [mode for mode in MODES if mode != "trl"],
                   "measure": "reward", "note": "held-out reward: the mean of 8 completions sampled a prompt",
                   "steps": 50, "seeds": 10, "eval_every": 5, "eval_prompts": 64, "eval_samples": 8,
                   "threshold": 0.7, "parallel": 1, "sampling": {"group_size": 8, "max_new_tokens": 8},
                   "trainer": {"groups_per_step": 8, "lr": 3e-3}, "lora": {"enabled": False}},
    # Side by side with TRL (issue 66): `make up`'s work (SmolLM2, the math task, its batch and
    # learning rate), 20 steps, held out on `make up`'s 50 problems every 5 steps, greedy.
    "peer-trl": {"model": "smollm2", "task": {"name": "math", "params": {}},
                 "modes": ["trl", "colocated", "sequential", "async S=1"], "measure": "correct", "note": "",
                 "steps": 20, "seeds": 5, "eval_every": 5, "eval_prompts": 50, "threshold": 0.3, "parallel": 1,
                 "sampling": {"group_size": 8, "max_new_tokens": 24}, "trainer": {"groups_per_step": 4, "lr": 1e-4},
                 "lora": {}},
}
# Stated prices (USD an hour), to turn busy time into cost: an H100 rented on demand for the
# trainer, a consumer GPU for a sampler. Change them with --trainer-price / --sampler-price.
PRICES = {"trainer": 2.50, "sampler": 0.40}
# What each run keeps of every step's metrics line (workers/trainer/accounting.py).
STEP_KEYS = ("reward_mean", "is_ratio_mean", "is_ratio_max", "is_truncated_fraction", "rs_rejected_tokens",
             "mismatch_kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction",
             "kl", "grad_norm", "entropy", "wall_seconds", "busy_seconds", "generated_seconds", "used", "dropped_stale",
             "staleness_used", "rejected", "reward_mismatch", "verifier_errors")


def run_config(preset: dict, mode: str, seed: int, runs_dir: Path, overrides: list[str] = ()) -> EchoConfig:
    slug = mode.replace(" ", "-").replace("=", "")
    sections = {
        "run": {"id": f"{slug}-seed{seed}", "dir": str(runs_dir), "steps": preset["steps"], "seed": seed,
                "eval_prompts": 0},
        "model": {"name": preset["model"]},
        "task": preset["task"],
        "lora": preset["lora"],
        "sampling": preset["sampling"],
        # Every version kept until the run's curve is scored (then its weights are deleted); the
        # proof of sampling checks every mode's groups alike.
        "trainer": {**preset["trainer"], "keep_versions": preset["steps"] + 1},
        "sampler": {"count": 2},
    }
    for section, values in MODES[mode].items():
        sections[section] = {**sections.get(section, {}), **values}
    for assignment in overrides:
        apply_override(sections, assignment)
    return validate_config(sections)


def schedule(modes: list[str], seeds: range) -> list[tuple[str, int]]:
    """Seed by seed, each seed's modes in an order rotated by one from the last seed's: over as
    many seeds as modes, every mode runs once in every position."""
    return [(modes[(i + j) % len(modes)], seed) for i, seed in enumerate(seeds) for j in range(len(modes))]


def run_one(cfg: EchoConfig, mode: str, log_dir: Path) -> None:
    """One run in its own processes: `echo-rl up`, or the co-located baseline."""
    config_path = log_dir / f"{cfg.run.id}.toml"
    config_path.write_text(cfg.to_toml())
    one_process = {"colocated": "bench.colocated", "trl": "bench.peer_trl"}
    command = ([sys.executable, "-m", one_process[mode], "--config", str(config_path)] if mode in one_process
               else [sys.executable, "-m", "workers.cli", "up", "--config", str(config_path), "--log-json"])
    with open(log_dir / f"{cfg.run.id}.log", "wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{cfg.run.id} failed ({done.returncode}): see {log_dir / cfg.run.id}.log")


def run_summary(cfg: EchoConfig, mode: str) -> dict:
    """A run's pace, waste and per-step metrics, from its metrics.jsonl."""
    lines = read_metrics(cfg.run_dir)
    summary_file = cfg.run_dir / "summary.json"  # `echo-rl up`'s, with its processes' peak memory
    summary = orjson.loads(summary_file.read_bytes()) if summary_file.exists() else {}
    wall = lines[-1]["wall_seconds"]
    # One process does both in the co-located run: its "sampler" is the same device, part time.
    sampler_count = 1 if mode in ONE_PROCESS else cfg.sampler.count
    trained = sum(r["tokens"] for r in lines)
    wasted = sum(r["dropped_tokens"] for r in lines)
    busy, generated = sum(r["busy_seconds"] for r in lines), sum(r["generated_seconds"] for r in lines)
    return {
        "seed": cfg.run.seed,
        "run_id": cfg.run.id,
        "wall_seconds": wall,
        "seconds_per_step": wall / len(lines),
        "learner_seconds": busy,
        "sampler_seconds": generated,
        "utilisation": busy / wall,  # the learner's, as the trainer's status says it
        "sampler_utilisation": generated / (sampler_count * wall),
        "wasted_token_fraction": wasted / max(trained + wasted, 1),
        "dropped_groups": sum(r["dropped_stale"] for r in lines),
        "rejected": dict(sum((Counter(r.get("rejected", {})) for r in lines), Counter())),
        "reward_mismatch": dict(sum((Counter(r.get("reward_mismatch", {})) for r in lines), Counter())),
        "proof_of_sampling": lines[-1].get("proof_of_sampling", {}),  # the trainer's running count
        "peak_rss_mb": max((r.get("peak_rss_mb", 0.0) for r in lines), default=0.0),  # the trainer's process
        # Every token sampled for the steps, kept or dropped stale; those in flight at the end are not counted.
        "tokens_per_second": (trained + wasted) / wall,
        # `echo-rl up`'s samplers, each its own process (the one-process modes have none apart).
        "sampler_peak_rss_mb": max((mb for name, mb in summary.get("peak_rss_mb", {}).items() if name != "trainer"),
                                   default=0.0),
        "steps": [{key: r[key] for key in STEP_KEYS if key in r} for r in lines],
    }


class HeldOut:
    """One engine that scores the base model once, then runs' kept versions: greedy, or by
    `samples` completions a prompt drawn alike for every version."""

    def __init__(self, cfg: EchoConfig, n: int, samples: int = 0):
        self.engine, self.task, self.samples = make_engine(cfg), load_task(cfg.task), samples
        self.prompts = self.task.held_out(n)
        self.batch = 64 if resolve_device(cfg.model.device).type == "cuda" else 16
        self.max_tokens = cfg.sampling.max_new_tokens
        self.lock = threading.Lock()  # runs finish in several threads; one engine
        reward, correct = self.score()  # the engine starts as the base model
        self.base = {"prompts": len(self.prompts), "reward": reward, "correct": correct}

    def score(self) -> tuple[float, float]:
        return held_out_score(self.engine, self.task, self.prompts, self.max_tokens, self.batch, self.samples)

    def curve(self, run_dir: Path, steps: int, every: int) -> list[list[float]]:
        """[step, held-out correct, held-out reward] at step 0 (the base model) and every `every`
        steps to the last."""
        points = [[0, self.base["correct"], self.base["reward"]]]
        with self.lock:
            for step in sorted({*range(every, steps + 1, every), steps}):
                self.engine.load_weights(read_shards(weights_at(run_dir, step)))
                reward, correct = self.score()
                points.append([step, correct, reward])
        return points


def area_under(curve: list[list[float]], at: int = MEASURES["correct"]) -> float:
    """The held-out curve's mean height over the run (trapezoids over steps), of the measure
    its points keep `at`: learning early counts as well as learning at all."""
    area = sum((b[0] - a[0]) * (a[at] + b[at]) / 2 for a, b in itertools.pairwise(curve))
    return area / (curve[-1][0] - curve[0][0])


def reached(curve: list[list[float]], threshold: float, at: int = MEASURES["correct"]) -> tuple[int, bool]:
    """(the first step whose held-out measure is at least `threshold`, True), or (the last step,
    False): a time to an event, censored where it did not happen."""
    return next(((point[0], True) for point in curve[1:] if point[at] >= threshold), (curve[-1][0], False))


def logrank_p(a: list[tuple[float, bool]], b: list[tuple[float, bool]]) -> float:
    """Two-sided p-value of the log-rank test that two groups reach an event at the same rate.
    Each item is (time, the event happened), else censored at that time."""
    observed_minus_expected = variance = 0.0
    for t in sorted({when for when, event in a + b if event}):
        at_risk_a, at_risk_b = sum(when >= t for when, _ in a), sum(when >= t for when, _ in b)
        events_a = sum(when == t and event for when, event in a)
        events = events_a + sum(when == t and event for when, event in b)
        n = at_risk_a + at_risk_b
        observed_minus_expected += events_a - events * at_risk_a / n
        if n > 1:
            variance += events * (at_risk_a / n) * (at_risk_b / n) * (n - events) / (n - 1)
    if variance == 0:
        return 1.0
    return math.erfc(math.sqrt(observed_minus_expected**2 / variance / 2))  # chi-square, 1 degree of freedom


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


def detectable_gap(a: list[float], b: list[float], power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest gap in means a two-sided test at `alpha` finds with probability `power`, given
    the spread these seeds show (pooled standard deviation; the normal approximation, which at 10
    seeds a mode is ~6% smaller than a t-test's): what a verdict of "within noise" can rule out."""
    z = statistics.NormalDist()
    pooled = math.sqrt(((len(a) - 1) * statistics.variance(a) + (len(b) - 1) * statistics.variance(b))
                       / (len(a) + len(b) - 2))
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * pooled * math.sqrt(1 / len(a) + 1 / len(b))


def run_cost(run: dict, mode: str, prices: dict) -> float:
    """USD for a run's busy time at the stated hourly prices."""
    if mode in ONE_PROCESS:
        return run["wall_seconds"] * prices["trainer"] / 3600
    return (run["learner_seconds"] * prices["trainer"] + run["sampler_seconds"] * prices["sampler"]) / 3600


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def current(run: dict) -> dict:
    """A run as recorded before 2026-12-07 (`learner_busy`, `sampler_busy`) in today's words."""
    renamed = {"learner_busy": "utilisation", "sampler_busy": "sampler_utilisation"}
    return {renamed.get(k, k): v for k, v in run.items()}


def mode_summary(mode: str, runs: list[dict], base: dict, threshold: float, prices: dict,
                 measure: str = "correct") -> dict:
    runs = [current(r) for r in runs]
    at, costs = MEASURES[measure], [run_cost(r, mode, prices) for r in runs]
    gain = statistics.fmean(r["curve"][-1][at] for r in runs) - base[measure]
    return {
        "runs": runs,
        "reached": sum(reached(r["curve"], threshold, at)[1] for r in runs),
        "cost_usd": _spread(costs),
        # Per percentage point of the held-out measure over the base model's; none where it gained nothing.
        "usd_per_point": statistics.fmean(costs) / (100 * gain) if gain > 0 else None,
        "final": _spread([r["curve"][-1][at] for r in runs]),
        "auc": _spread([area_under(r["curve"], at) for r in runs]),
        **{key: _spread([r[key] for r in runs]) for key in (
            "seconds_per_step", "utilisation", "sampler_utilisation", "wasted_token_fraction")},
        # Runs before each was measured: 0.
        **{key: _spread([r.get(key, 0.0) for r in runs]) for key in (
            "peak_rss_mb", "sampler_peak_rss_mb", "tokens_per_second")},
        "off_policy": off_policy(runs),
    }


def off_policy(runs: list[dict]) -> dict:
    """How far off-policy a mode trained: the versions between a group's sampling and its step,
    and the importance ratios and train/inference mismatch the learner measured (each run's
    mean over its steps, spread over runs; the ratio's max is each run's largest)."""
    def mean_staleness(run: dict) -> float:
        used = Counter()
        for step in run["steps"]:
            used.update({int(age): n for age, n in step.get("staleness_used", {}).items()})
        return sum(age * n for age, n in used.items()) / max(sum(used.values()), 1)

    def over_steps(key: str, pick=statistics.fmean) -> list[float]:
        return [pick(s[key] for s in r["steps"] if key in s) for r in runs if any(key in s for s in r["steps"])]

    measured = {"staleness": [mean_staleness(r) for r in runs], "is_ratio_max": over_steps("is_ratio_max", max),
                **{key: over_steps(key) for key in ("is_ratio_mean", "is_truncated_fraction", "mismatch_kl")}}
    return {key: _spread(values) for key, values in measured.items() if values}


def verdict(modes: dict, reference: str, other: str, threshold: float, measure: str = "correct") -> dict:
    """Does `other` differ from `reference` in the final held-out measure, in the area under the
    held-out curve, or in steps to `threshold`? And how much faster per wall-clock second is it?"""
    at, a, b = MEASURES[measure], modes[reference]["runs"], modes[other]["runs"]
    finals = [[r["curve"][-1][at] for r in runs] for runs in (a, b)]
    areas = [[area_under(r["curve"], at) for r in runs] for runs in (a, b)]
    times = [[reached(r["curve"], threshold, at) for r in runs] for runs in (a, b)]
    p = {"final": permutation_p(*finals), "auc": permutation_p(*areas), "threshold": logrank_p(*times)}
    # Every score the same (e.g. the tiny model scoring 0 everywhere): nothing to judge.
    signal = len(set(finals[0] + finals[1])) > 1 or len(set(areas[0] + areas[1])) > 1
    return {"final_gap": round(statistics.fmean(finals[1]) - statistics.fmean(finals[0]), 4),
            "auc_gap": round(statistics.fmean(areas[1]) - statistics.fmean(areas[0]), 4),
            "reached": [sum(event for _, event in t) for t in times],
            "p_values": {k: round(v, 4) for k, v in p.items()},
            "within_noise": min(p.values()) >= 0.05 if signal else None,
            # One seed a mode has no spread to judge by.
            "detectable": {"final": round(detectable_gap(*finals), 4), "auc": round(detectable_gap(*areas), 4)}
            if min(len(a), len(b)) > 1 else None,
            "speed_vs_reference": round(modes[reference]["seconds_per_step"]["mean"]
                                        / modes[other]["seconds_per_step"]["mean"], 3)}


def summarize(results: dict) -> dict:
    """Each mode's spreads, costs and the verdicts, computed from the runs (again, after --add)."""
    runs, measure = results["runs"], results.get("measure", "correct")  # studies before measures: correct
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    results["modes"] = {mode: mode_summary(mode, rs, results["base"], results["threshold"], results["prices"], measure)
                        for mode, rs in by_mode.items() if rs}
    pairs = [(reference, other) for reference in ("sequential", "colocated") if reference in results["modes"]
             for other in results["modes"] if other.startswith("async")]
    if "trl" in results["modes"]:  # the peer: every echo-rl mode against it
        pairs = [("trl", other) for other in results["modes"] if other != "trl"] + pairs
    if {"async S=8", "async S=8 no IS"} <= results["modes"].keys():
        pairs.append(("async S=8", "async S=8 no IS"))  # what the correction is worth, where it matters most
    # What four updates a batch cost at S = 4, and what IcePop's mask is worth with them.
    pairs += [pair for pair in (("async S=4", "async S=4 x4"), ("async S=4 x4", "async S=4 x4 IcePop"))
              if set(pair) <= results["modes"].keys()]
    results["verdict"] = {f"{other} vs {reference}": verdict(results["modes"], reference, other, results["threshold"],
                                                             measure) for reference, other in pairs}
    return results


def code_version() -> str:
    """The commit of the code a run ran (results are not code: a study that commits each run's
    results with --commit moves HEAD, not the code), and "+changes" if the code has some."""
    root, code = Path(__file__).parent.parent, [".", ":(exclude)bench/results"]
    commit = subprocess.run(["git", "log", "-1", "--format=%h", "--", *code], cwd=root, capture_output=True,
                            text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *code], cwd=root,
                           capture_output=True, text=True).stdout
    return commit.strip() + ("+changes" if dirty.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--modes", help="comma-separated, of: " + ", ".join(MODES) + " (the preset's by default)")
    parser.add_argument("--seeds", type=int, help="seeds a mode (the preset's by default)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--parallel", type=int, help="runs at once")
    parser.add_argument("--trainer-price", type=float, default=PRICES["trainer"], help="USD an hour")
    parser.add_argument("--sampler-price", type=float, default=PRICES["sampler"], help="USD an hour")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="every run's config")
    parser.add_argument("--work-dir", help="keep the runs' logs and metrics here (default: a temporary folder)")
    parser.add_argument("--add", action="store_true", help="add to the runs already in the results file")
    parser.add_argument("--resume", action="store_true", help="add to the results file, running only the planned "
                        "runs it does not hold yet (a study stopped part way goes on where it stopped)")
    parser.add_argument("--commit", action="store_true", help="git-commit the results file after every run, so a "
                        "study that runs in the background of several sessions keeps each run it finished")
    parser.add_argument("--report", action="store_true", help="run nothing: the verdict, table and PNG again "
                        "from the results file")
    parser.add_argument("--out", default=str(results_dir()))
    args = parser.parse_args()
    path = Path(args.out) / f"parity-{args.preset}.json"
    prices = {"trainer": args.trainer_price, "sampler": args.sampler_price}
    if args.report:
        results = summarize({**orjson.loads(path.read_bytes()), "prices": prices})
        return show(results, path)
    preset = dict(PRESETS[args.preset], **{k: v for k, v in (("seeds", args.seeds), ("parallel", args.parallel)) if v})
    modes = args.modes.split(",") if args.modes else preset["modes"]
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {list(MODES)}")
    results = {"preset": args.preset, "model": preset["model"], "steps": preset["steps"], "task": preset["task"],
               "eval_every": preset["eval_every"], "eval_samples": preset.get("eval_samples", 0),
               "threshold": preset["threshold"], "measure": preset["measure"],
               "prices": prices, "note": preset["note"], "runs": []}
    if args.add or (args.resume and path.exists()):
        results = added_to(path, results)
    planned = schedule(modes, range(args.first_seed, args.first_seed + preset["seeds"]))
    done = {(r["mode"], r["seed"]) for r in results["runs"]}
    if args.resume:
        planned = [run for run in planned if run not in done]
    elif repeated := set(planned) & done:
        parser.error(f"already in the results: {sorted(repeated)} (--first-seed, or --resume)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        configs = {(m, s): run_config(preset, m, s, work / "runs", args.set) for m, s in planned}
        held_out = HeldOut(next(iter(configs.values())), preset["eval_prompts"], preset.get("eval_samples", 0))
        results["base"] = held_out.base
        writing = threading.Lock()

        def measure(mode: str, seed: int) -> None:
            cfg, started, began = configs[mode, seed], time.time(), time.monotonic()
            run_one(cfg, mode, work / "logs")
            run = {"mode": mode, **run_summary(cfg, mode), "started_at": round(started), "code": code_version(),
                   "machine": machine(), "load": MACHINE.report(since=began), "overrides": args.set,
                   "curve": held_out.curve(cfg.run_dir, preset["steps"], preset["eval_every"])}
            shutil.rmtree(cfg.run_dir / "weights")  # a study's versions would fill the disk
            with writing:  # after each run: a study cut short keeps what it measured
                results["runs"].append(run)
                write(summarize(results), path)
                if args.commit:
                    commit_results(path, f"{args.preset}: {mode} seed {seed}")
            print(f"{mode} seed {seed}: held-out {results['measure']} "
                  f"{run['curve'][-1][MEASURES[results['measure']]]:.3f}", flush=True)

        with ThreadPoolExecutor(preset["parallel"]) as pool:
            list(pool.map(lambda planned_run: measure(*planned_run), planned))
    show(results, path)


def added_to(path: Path, results: dict) -> dict:
    """The runs already in `path`, measured the same way (a device lends 10 minutes a call)."""
    earlier = orjson.loads(path.read_bytes())
    before_the_key = {"measure": "correct", "eval_samples": 0}  # what a study that did not record it did
    for key in ("preset", "model", "steps", "task", "eval_every", "eval_samples", "measure"):
        if earlier.get(key, before_the_key.get(key)) != results[key]:
            raise SystemExit(f"--add: {path} has {key} {earlier[key]!r}, this run {results[key]!r}")
    return {**earlier, "prices": results["prices"]}


def commit_results(path: Path, what: str) -> None:
    """Commit the results file alone (whatever else the work tree holds) in the repository that
    holds it, with the run it adds."""
    for command in (["add", "--"], ["commit", "--quiet", "-m", f"bench.parity {what}", "--"]):  # new the first time
        subprocess.run(["git", *command, path.name], cwd=path.parent, check=True)


def write(results: dict, path: Path) -> None:
    """The results, each run once: a mode's summary names its runs by seed (summarize makes them
    again from `runs` when the file is read)."""
    modes = {mode: {**m, "runs": [r["seed"] for r in m["runs"]]} for mode, m in results.get("modes", {}).items()}
    path.write_bytes(orjson.dumps({**results, "modes": modes}, option=orjson.OPT_INDENT_2))


def show(results: dict, path: Path) -> None:
    write(results, path)
    plot(results, path.with_suffix(".png"))
    print(table(results))


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return f"{gpu}, {os.cpu_count()} CPU cores" if gpu else f"{os.cpu_count()} CPU cores, no GPU"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measure = results.get("measure", "correct")
    fig, (held, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, m in results["modes"].items():
        runs = m["runs"]
        steps = [point[0] for point in runs[0]["curve"]]
        scores = [[r["curve"][i][MEASURES[measure]] for r in runs] for i in range(len(steps))]
        line, = held.plot(steps, [statistics.fmean(c) for c in scores], marker="o", label=f"{mode} ({len(runs)})")
        held.fill_between(steps, [min(c) for c in scores], [max(c) for c in scores], alpha=0.12,
                          color=line.get_color())
        last = min(len(r["steps"]) for r in runs)
        seconds = [statistics.fmean(r["steps"][i]["wall_seconds"] for r in runs) for i in range(last)]
        rewards = [statistics.fmean(r["steps"][i]["reward_mean"] for r in runs) for i in range(last)]
        by_time.plot(seconds, rewards, label=mode, color=line.get_color())
    held.axhline(results["threshold"], color="grey", linestyle=":", linewidth=1)
    held.set(xlabel="step", ylabel=f"held-out {measure} (mean over seeds, band: min-max)")
    by_time.set(xlabel="wall-clock seconds (mean over seeds)", ylabel="training reward (mean over seeds)")
    held.legend()
    fig.suptitle(f"{results['model']} on {results['task']['name']}: {results['steps']} steps, "
                 f"{len(results['runs'])} runs, {results['runs'][0]['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measured(mode: dict, key: str, stat: str = "max") -> str:
    """A figure over the runs that measured it ("-" where none did: runs from before it was)."""
    values = [v for v in mode.get(key, {}).get("values", []) if v]
    return f"{(max(values) if stat == 'max' else statistics.fmean(values)):.0f}" if values else "-"


def table(results: dict) -> str:
    rows = [f"| mode | seeds | held-out {results.get('measure', 'correct')} final | area under curve "
            "| reached threshold | s/step | learner busy | sampler busy | tokens wasted | staleness trained "
            "| IS ratio mean (max) | mismatch KL | USD a run | USD a point | trainer peak MB | sampler peak MB "
            "| tokens/s |",
            "| --- " * 17 + "|"]
    for mode, m in results["modes"].items():
        per_point = f"{m['usd_per_point']:.4f}" if m["usd_per_point"] is not None else "no gain"
        off = m["off_policy"]
        rows.append(f"| {mode} | {len(m['runs'])} | {m['final']['mean']:.3f} ± {m['final']['std']:.3f} "
                    f"| {m['auc']['mean']:.3f} ± {m['auc']['std']:.3f} | {m['reached']} of {len(m['runs'])} "
                    f"| {m['seconds_per_step']['mean']:.2f} | {m['utilisation']['mean']:.2f} "
                    f"| {m['sampler_utilisation']['mean']:.2f} | {m['wasted_token_fraction']['mean']:.3f} "
                    f"| {off['staleness']['mean']:.2f} | {_of(off, 'is_ratio_mean', 'mean')} "
                    f"({_of(off, 'is_ratio_max', 'max')}) | {_of(off, 'mismatch_kl', 'mean', '.2g')} "
                    f"| {m['cost_usd']['mean']:.4f} | {per_point} | {measured(m, 'peak_rss_mb')} "
                    f"| {measured(m, 'sampler_peak_rss_mb')} | {measured(m, 'tokens_per_second', 'mean')} |")
    base = results["base"]
    rows.append(f"\nbase model: correct {base['correct']:.3f}, reward {base['reward']:.3f} on {base['prompts']} "
                f"prompts; threshold {results['threshold']}; prices {results['prices']} USD an hour")
    judged = {True: "within noise", False: "NOT within noise", None: "no signal to judge"}
    rows += [f"{name}: final {v['final_gap']:+.4f} (p = {v['p_values']['final']:.3f}), area {v['auc_gap']:+.4f} "
             f"(p = {v['p_values']['auc']:.3f}), reached {v['reached'][1]} vs {v['reached'][0]} "
             f"(log-rank p = {v['p_values']['threshold']:.3f}) -> {judged[v['within_noise']]}; "
             + (f"gaps these seeds find 4 times in 5: final {v['detectable']['final']:.3f}, "
                f"area {v['detectable']['auc']:.3f}; " if v["detectable"] else "")
             + f"{v['speed_vs_reference']:.2f}x the steps per second"
             for name, v in results["verdict"].items()]
    return "\n".join(rows)


def _of(measured: dict, key: str, stat: str, form: str = ".3f") -> str:
    return format(measured[key][stat], form) if key in measured else "-"


if __name__ == "__main__":
    main()
