"""Benchmark: one trainer step on 1 process and on 2 ranks (FSDP2 over gloo on this CPU), with
and without micro-batching: step time and each rank's peak resident memory. Every setting runs
in fresh processes (ru_maxrss is per process); the baseline, 1 process with whole groups, runs
in the same invocation.

    .venv/bin/python -m bench.ranks [--model smollm2] [--groups 2] [--group 8] [--tokens 256] [--budgets 0 1024]

On a CPU two ranks share the same cores, so expect no speed-up: what 2 ranks buy here is memory
per process (each holds half the trained tensors and optimizer state, and half the step's
activations). Writes bench/results/ranks.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import orjson
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import write_results
from bench.micro_batches import step_setup, timed_step


def rank_step(rank: int, world: int, port: int, args, budget: int, out: Path) -> None:
    from workers.trainer.model import leave, shard

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo")
    # On the CPU: the ranks talk over gloo, as this bench measures them.
    cfg, policy, pad_id, batch, compute_dtype = step_setup(args.model, args.groups, args.group, args.tokens, budget,
                                                           device="cpu")
    if world > 1:
        shard(policy)
    result = {"rank": rank, **timed_step(cfg, policy, pad_id, batch, compute_dtype, rank=rank, world=world)}
    (out / f"rank{rank}.json").write_bytes(orjson.dumps(result))
    if world > 1:
        leave()


def setting(world: int, budget: int, args) -> dict:
    from streams.server import free_port

    with tempfile.TemporaryDirectory() as tmp:  # each rank's result, written by its own process
        mp.spawn(rank_step, args=(world, free_port(), args, budget, Path(tmp)), nprocs=world)
        ranks = [orjson.loads((Path(tmp) / f"rank{r}.json").read_bytes()) for r in range(world)]
    return {"ranks": world, "micro_batch_tokens": budget, "step_s": max(r["step_s"] for r in ranks),
            "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
            "before_step_rss_mb_per_rank": [r["before_step_rss_mb"] for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 1024])
    args = parser.parse_args()
    runs = [setting(world, budget, args) for budget in args.budgets for world in (1, 2)]
    baseline = runs[0]
    for run in runs:
        run["time_vs_one_process_whole"] = round(run["step_s"] / baseline["step_s"], 2)
        run["peak_vs_one_process_whole"] = round(max(run["peak_rss_mb_per_rank"]) / baseline["peak_rss_mb_per_rank"][0], 2)
    result = {"model": args.model, "machine": f"{os.cpu_count()} CPU cores, gloo",
              "batch": f"{args.groups} groups of {args.group} completions x {args.tokens} tokens, prompt 64",
              "runs": runs}
    print(write_results("ranks.json", result).read_text())


if __name__ == "__main__":
    main()
