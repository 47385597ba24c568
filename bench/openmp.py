"""Benchmark: torch's OpenMP threads waiting actively (libgomp's default) or passively (what every
process of ours asks for, echo/__init__.py), alone on the box and beside busy processes (a sampler
beside the trainer, another job). Each measure runs in a process of its own, since OpenMP reads
OMP_WAIT_POLICY once, when torch loads it: the tiny model's engine generates `tokens` tokens for a
batch of 2, `calls` times, with torch's default threads (the box's cores). Rounds alternate the
policies, so both see the same load; speeds are given as ratios to passive's, in the same run.

    .venv/bin/python -m bench.openmp [--busy 0 1] [--rounds 3]

Writes bench/results/openmp.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from bench.common import write_results

MEASURE = """
import sys, time
import torch
from echo.config import validate_config
from echo.engines import make_engine

engine = make_engine(validate_config({"model": {"name": "tiny"}}))
prompts = [engine.encode_chat([{"role": "user", "content": f"Count to {i}"}]) for i in (3, 4)]
engine.generate(prompts, 1, greedy=True, max_tokens=4)  # warm
began = time.perf_counter()
for _ in range(int(sys.argv[2])):
    engine.generate(prompts, 1, greedy=True, max_tokens=int(sys.argv[1]))
print(time.perf_counter() - began, torch.get_num_threads())
"""
BURN = "while True: pass"


def measure(policy: str, tokens: int, calls: int) -> tuple[float, int]:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tokens), str(calls)], env=env, capture_output=True,
                         text=True, check=True)
    seconds, threads = out.stdout.split()
    return float(seconds), int(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="busy processes beside it (each one core)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    results = []
    for busy in args.busy:
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(busy)]
        try:
            seconds: dict[str, list[float]] = {"PASSIVE": [], "ACTIVE": []}
            for _ in range(args.rounds):
                for policy in seconds:
                    took, threads = measure(policy, args.tokens, args.calls)
                    seconds[policy].append(took)
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
        median = {policy: statistics.median(s) for policy, s in seconds.items()}
        results.append({"busy_processes": busy, "torch_threads": threads, "seconds": seconds,
                        "active_over_passive": round(median["ACTIVE"] / median["PASSIVE"], 2)})
        print(f"{busy} busy beside: {args.calls} calls of {args.tokens} tokens, passive {median['PASSIVE']:.2f} s, "
              f"active {median['ACTIVE']:.2f} s ({results[-1]['active_over_passive']}x)", flush=True)
    write_results("openmp.json", {"model": "tiny", "batch": 2, "tokens": args.tokens, "calls": args.calls,
                                  "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
