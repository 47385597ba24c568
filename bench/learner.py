"""Benchmark: the learner's step at the shapes that matter, its tokens/s, MFU and where its time
goes (torch.profiler). For the GPU measurements of issue 32: the parity study's batch (8 groups
x 8 completions of 32 tokens) and a reasoning-length group (16 completions of 1,024 tokens).

Each shape runs as the trainer runs it (bench/micro_batches.py's step_setup: the base in
model.dtype on model.device, the LoRA adapter fp32), the fastest of `--repeats` steps after one
warm-up. MFU counts the model's matrix work only: a LoRA step costs ~4 N FLOPs a token (forward
2 N, the backward's activation gradients 2 N; the frozen weights get no gradient), N the
parameters, over the device's dense peak (`--peak-tflops`, an H100's bf16 989 by default on a
GPU; none on a CPU). With --profile, each shape's step runs once more under torch.profiler and
the ops that took the most self time (the device's on a GPU) are kept.

    .venv/bin/python -m bench.learner --model tiny --repeats 2 --profile       # here: checks the harness
    python -m bench.learner --model smollm2 --repeats 5 --profile              # an H100: the figures

Writes bench/results/learner-<model>-<device>.json.
"""

from __future__ import annotations

import argparse
import time

from bench.common import write_results
from bench.micro_batches import step_setup

SHAPES = {"parity": (8, 8, 32), "long": (1, 16, 1024)}  # groups, completions a group, tokens a completion
H100_BF16_TFLOPS = 989.0  # dense, SXM


def profile_step(cfg, policy, pad_id, batch, compute_dtype, top: int = 15) -> list[dict]:
    """The ops of one step that took the most self time, with their calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from echo.model.devices import model_device
    from echo.train.learner import Forward, make_optimizer, train_step

    device = model_device(policy)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    optimizer = make_optimizer(policy, cfg)
    with profile(activities=activities) as prof:
        train_step(Forward.of(policy, cfg, pad_id, compute_dtype), optimizer, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    on_device = device.type == "cuda"
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total if on_device else e.self_cpu_time_total,
                    reverse=True)
    total = sum(e.self_device_time_total if on_device else e.self_cpu_time_total for e in events)
    return [{"op": e.key, "calls": e.count,
             "self_ms": round((e.self_device_time_total if on_device else e.self_cpu_time_total) / 1000, 3),
             "share": round((e.self_device_time_total if on_device else e.self_cpu_time_total) / max(total, 1), 4)}
            for e in events[:top]]


def measure(model: str, shape: str, repeats: int, pack_groups: str, device: str, dtype: str, peak_tflops: float | None,
            profile: bool, budget: int = 4096) -> dict:
    import torch

    from echo.model.devices import dtype_name, model_device
    from echo.train.learner import Forward, make_optimizer, train_step

    groups, group, tokens = SHAPES[shape]
    cfg, policy, pad_id, batch, compute_dtype = step_setup(model, groups, group, tokens, budget, pack_groups, device, dtype)
    on = model_device(policy)
    optimizer = make_optimizer(policy, cfg)
    seconds = []
    for _ in range(repeats + 1):  # the first warms up (kernels, allocator)
        started = time.perf_counter()
        stats = train_step(Forward.of(policy, cfg, pad_id, compute_dtype), optimizer, batch)
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        seconds.append(time.perf_counter() - started)
    step_s = round(min(seconds[1:]), 4)  # the rates below are of the step reported
    parameters = sum(p.numel() for p in policy.parameters())
    # Every token of the step goes through the model: the prompts' too (once a group when packed).
    tokens_in = sum(len(g.prompt_token_ids) + sum(len(c.token_ids) for c in g.completions)
                    for g in (r.group for r in batch.groups))
    flops = 4 * parameters * tokens_in
    peak = peak_tflops if peak_tflops is not None else (H100_BF16_TFLOPS if on.type == "cuda" else None)
    result = {"shape": shape, "groups": groups, "completions": group, "tokens": tokens, "device": str(on),
              "device_name": torch.cuda.get_device_name(on) if on.type == "cuda" else "cpu",
              "dtype": dtype_name(compute_dtype), "pack_groups": pack_groups, "micro_batch_tokens": budget,
              "passes": stats["passes"],
              "step_s": step_s, "completion_tokens_per_s": round(stats["tokens"] / step_s, 1),
              "tflops_per_s": round(flops / step_s / 1e12, 3),
              "mfu": round(flops / step_s / (peak * 1e12), 5) if peak else None, "parameters": parameters}
    if profile:
        result["profile"] = profile_step(cfg, policy, pad_id, batch, compute_dtype)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pack-groups", default="auto", choices=["auto", "on", "off"], help="trainer.pack_groups")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="trainer.micro_batch_tokens")
    parser.add_argument("--device", default="auto", help="model.device")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="model.dtype")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense peak for MFU (default: an H100's bf16)")
    parser.add_argument("--profile", action="store_true", help="keep the top ops of one profiled step")
    args = parser.parse_args()
    runs = [measure(args.model, shape, args.repeats, args.pack_groups, args.device, args.dtype, args.peak_tflops,
                    args.profile, args.micro_batch_tokens) for shape in args.shapes]
    where = "gpu" if runs[0]["device"].startswith("cuda") else runs[0]["device"].split(":")[0]
    out = write_results(f"learner-{args.model}-{where}.json", {"model": args.model, "runs": runs})
    print(out.read_text())


if __name__ == "__main__":
    main()
