"""Does routing replay keep a mixture of experts' training steadier? The controlled study of
issue 68: the tiny MoE (Qwen3-MoE, 8 experts, top-2), full weights (the routers learn too), on
the letters task it learns from step 0 (bench/letters.py), co-located (bench/colocated.py:
generate with the current weights, then train on them), the sampler in bf16 and the trainer in
fp32: the mismatch is routing and rounding only, no staleness. Two modes, `algorithm.router_replay`
off and replay, `--seeds` seeds each, interleaved seed by seed (the order rotated), the same
config otherwise (token-level truncated importance sampling at 2, the default).

For each run, from its metrics: the largest importance ratio pi_old / mu over the run, the mean
mismatch KL(mu || pi_old), the mean share of tokens truncated, the largest gradient norm, and the
reward: its mean over the last five steps and its mean over all (the area under its curve). For
each measure the verdict compares the modes with a permutation test over seeds (bench/parity.py's):
"replay steadier" where replay's is lower at p < 0.05, "within noise" where no gap is found.

    python -m bench.moe_study [--seeds 10] [--steps 30]

Writes the `study` part of bench/results/moe.json (bench/moe.py writes the mismatch figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench.colocated import run_colocated
from bench.common import MACHINE, results_dir
from bench.parity import permutation_p
from echo.config import validate_config
from echo.engines.hf import HFEngine
from echo.train.metrics import read_metrics

MODES = ("off", "replay")
# Lower is steadier for each, but the rewards (higher is better: replay must not cost learning).
MEASURES = ("is_ratio_max", "mismatch_kl_mean", "truncated_mean", "grad_norm_max", "reward_final", "reward_area")


def run_config(mode: str, seed: int, steps: int, runs_dir: Path):
    return validate_config({
        "run": {"id": f"{mode}-{seed}", "dir": str(runs_dir), "steps": steps, "seed": seed},
        "model": {"name": "tiny-moe", "dtype": "float32"},  # the trainer's
        "lora": {"enabled": False},
        "task": {"name": "bench.letters:Letters", "params": {}},
        "sampling": {"group_size": 8, "max_new_tokens": 8, "dtypes": ["float32", "bfloat16"]},
        "trainer": {"groups_per_step": 8, "lr": 3e-3, "threads": 2},
        "algorithm": {"router_replay": mode},
    })


def run_one(mode: str, seed: int, steps: int, runs_dir: Path) -> dict:
    cfg = run_config(mode, seed, steps, runs_dir)
    engine = HFEngine(cfg.model.name, cfg.lora, cfg.sampling, dtype="bfloat16", record_routing=mode == "replay")
    started = time.perf_counter()
    run_colocated(cfg, engine)
    metrics = read_metrics(cfg.run_dir)
    rewards = [m["reward_mean"] for m in metrics]
    return {
        "mode": mode, "seed": seed, "seconds": round(time.perf_counter() - started, 1),
        "is_ratio_max": max(m["is_ratio_max"] for m in metrics),
        "mismatch_kl_mean": statistics.fmean(m["mismatch_kl"] for m in metrics),
        "truncated_mean": statistics.fmean(m["is_truncated_fraction"] for m in metrics),
        "grad_norm_max": max(m["grad_norm"] for m in metrics),
        "reward_final": statistics.fmean(rewards[-5:]),
        "reward_area": statistics.fmean(rewards),
        "rewards": [round(r, 4) for r in rewards],
        "ratio_max_by_step": [round(m["is_ratio_max"], 4) for m in metrics],
    }


def verdict(runs: list[dict]) -> dict:
    out = {}
    for measure in MEASURES:
        off, on = ([r[measure] for r in runs if r["mode"] == mode] for mode in MODES)
        p = permutation_p(off, on)
        better = statistics.fmean(on) > statistics.fmean(off) if measure.startswith("reward") else \
            statistics.fmean(on) < statistics.fmean(off)
        out[measure] = {"off": _spread(off), "replay": _spread(on), "p": round(p, 4),
                        "says": "within noise" if p >= 0.05 else ("replay better" if better else "replay worse")}
    return out


def _spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 6), "sd": round(statistics.stdev(values), 6) if len(values) > 1
            else 0.0, "max": round(max(values), 6)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for mode in MODES[seed % 2:] + MODES[: seed % 2]:  # each mode first in half the seeds
                runs.append(run_one(mode, seed, args.steps, Path(tmp)))
                print(orjson.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, list)}).decode(),
                      file=sys.stderr)
    path = results_dir() / "moe.json"
    report = orjson.loads(path.read_bytes()) if path.exists() else {}
    report["study"] = {
        "machine": MACHINE.report(), "seeds": args.seeds, "steps": args.steps,
        "setup": "tiny-moe full weights, letters task, co-located, sampler bf16, trainer fp32, 8 groups of 8 a step, "
                 "8 tokens, lr 3e-3, token TIS at 2",
        "verdict": verdict(runs), "runs": runs,
    }
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
