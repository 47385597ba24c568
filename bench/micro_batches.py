"""Benchmark: peak memory and time of one trainer step under `trainer.micro_batch_tokens`: on one
group of long completions (micro-batches: less memory), or on many groups of short ones (groups
packed into shared passes: fewer forwards). Each setting runs in a fresh process, so its peak
resident memory (ru_maxrss) is its own; the baseline (0: a group a pass, whole) runs in the same
invocation. With --repeats, the step's time is the fastest of that many (the first warms up).
The step runs where the trainer's would (`--device`, `--dtype`: model.device and model.dtype,
auto by default); on a GPU the peak that counts is the device's (torch's allocator), not the
process's resident memory. `--heads logits chunked` measures each setting both ways: the
log-probs from the model's whole logits (the learner before head_logprobs, and still its way for
a head that is not plain) and from the hidden states a chunk of positions at a time.

    .venv/bin/python -m bench.micro_batches [--model smollm2] [--group 16] [--tokens 256] [--budgets 0 2048 1024]
    .venv/bin/python -m bench.micro_batches --groups 8 --group 8 --tokens 32 --budgets 0 4096 --repeats 3 --pack-groups on
    .venv/bin/python -m bench.micro_batches --tokens 1024 --budgets 0 4096 --heads logits chunked

Writes bench/results/micro_batches.json (one group) or micro_batches-<model>-<N>-groups.json;
with two heads, -heads before .json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import orjson

from bench.common import write_results
from echo.train.metrics import peak_rss_mb


def long_groups(vocab: int, groups: int, group: int, tokens: int) -> list:
    """`groups` (group, rewards) pairs of `group` random completions of `tokens` tokens each
    after a 64-token prompt (seeded: every process builds the same)."""
    import torch

    from echo.train.learner import Batch, Rewarded
    from echo.wire.messages import Completion, RolloutGroup

    generator = torch.Generator().manual_seed(0)
    batch = []
    for g in range(groups):
        prompt = torch.randint(0, vocab, (64,), generator=generator).tolist()
        completions = [Completion(token_ids=torch.randint(0, vocab, (tokens,), generator=generator).tolist(),
                                  logprobs=[-1.0] * tokens, text="", claimed_reward=float(i % 2),
                                  finish_reason="length")
                       for i in range(group)]
        batch.append(Rewarded(RolloutGroup(group_id=f"g{g}", sampler_id="s", version=0, term=0, task="bench",
                                   prompt_index=g, slot=g + 1, prompt_token_ids=prompt, completions=completions,
                                   temperature=1.0, engine="hf", dtype="float32", gen_seconds=0.0, created_at=0.0),
                               [c.claimed_reward for c in completions]))
    return Batch(batch)


def step_setup(model: str, groups: int, group: int, tokens: int, budget: int, pack_groups: str = "auto",
               device: str = "auto", dtype: str = "auto"):
    """(config, policy, pad id, batch, compute dtype) for a bench step, as the trainer builds them
    (the base in its compute dtype on model.device, the adapter fp32), the same in every process
    (seeded)."""
    import torch

    from echo.config import validate_config
    from echo.model.devices import resolve_device, resolve_dtype
    from echo.model.loading import load_model
    from echo.model.policy import make_policy

    torch.manual_seed(0)
    cfg = validate_config({"model": {"name": model, "device": device, "dtype": dtype},
                           "trainer": {"micro_batch_tokens": budget, "pack_groups": pack_groups}})
    on = resolve_device(cfg.model.device)
    compute_dtype = resolve_dtype(cfg.model.dtype, on)
    base, tokenizer = load_model(model, on, compute_dtype)
    batch = long_groups(base.get_input_embeddings().num_embeddings, groups, group, tokens)
    return cfg, make_policy(base, cfg.lora), tokenizer.pad_token_id, batch, compute_dtype


def timed_step(cfg, policy, pad_id: int, batch, compute_dtype, repeats: int = 1, **ranks) -> dict:
    """The fastest of `repeats` steps (the first warms up), its passes, where it ran, and this
    process's peak resident memory before and after (and on a GPU, the device's peak)."""
    import torch

    from echo.model.devices import dtype_name, model_device
    from echo.train.learner import Forward, make_optimizer, train_step

    device = model_device(policy)
    optimizer = make_optimizer(policy, cfg)
    before = peak_rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        stats = train_step(Forward.of(policy, cfg, pad_id, compute_dtype), optimizer, batch, **ranks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    on_device = {"peak_device_mb": round(torch.cuda.max_memory_allocated(device) / 2**20)} if device.type == "cuda" else {}
    return {"passes": stats["passes"], "step_s": round(min(seconds), 3), "device": str(device),
            "dtype": dtype_name(compute_dtype), **on_device,
            "peak_rss_mb": round(peak_rss_mb()),
            "before_step_rss_mb": round(before)}


def one_step(model: str, groups: int, group: int, tokens: int, budget: int, repeats: int, pack_groups: str,
             device: str = "auto", dtype: str = "auto", head: str = "chunked") -> dict:
    import echo.model.policy

    if head == "logits":  # every model family as if its head were not plain: the whole logits
        echo.model.policy.PLAIN_HEADS = frozenset()
    return {"budget": budget, "head": head,
            **timed_step(*step_setup(model, groups, group, tokens, budget, pack_groups, device, dtype), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--groups", type=int, default=1, help="groups in the step")
    parser.add_argument("--group", type=int, default=16, help="completions per group")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 2048, 1024], help="trainer.micro_batch_tokens "
                        "settings; 0 (a group a pass, the baseline) always runs first")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pack-groups", default="auto", choices=["auto", "on", "off"], help="trainer.pack_groups")
    parser.add_argument("--device", default="auto", help="model.device")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="model.dtype")
    parser.add_argument("--heads", nargs="+", default=["chunked"], choices=["chunked", "logits"],
                        help="log-probs from the hidden states a chunk at a time, or from the whole logits; "
                        "the first is the baseline")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one setting
    parser.add_argument("--head", default="chunked", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(orjson.dumps(one_step(args.model, args.groups, args.group, args.tokens, args.one, args.repeats,
                                    args.pack_groups, args.device, args.dtype, args.head)).decode())
        return
    runs = []
    for head in args.heads:
        for budget in [0, *(b for b in args.budgets if b != 0)]:
            out = subprocess.run([sys.executable, "-m", "bench.micro_batches", "--model", args.model,
                                  "--groups", str(args.groups), "--group", str(args.group), "--tokens", str(args.tokens),
                                  "--repeats", str(args.repeats), "--pack-groups", args.pack_groups,
                                  "--device", args.device, "--dtype", args.dtype, "--one", str(budget), "--head", head],
                                 capture_output=True, text=True, check=True)
            runs.append(orjson.loads(out.stdout.strip().splitlines()[-1]))
    baseline = runs[0]
    peak = "peak_device_mb" if "peak_device_mb" in baseline else "peak_rss_mb"  # where the step's memory is
    for run in runs:
        run["peak_vs_whole_group"] = round(run[peak] / baseline[peak], 2)
        run["time_vs_whole_group"] = round(run["step_s"] / baseline["step_s"], 2)
        if len(args.heads) > 1:  # against the first head's run of the same budget
            first = next(r for r in runs if r["budget"] == run["budget"])
            run[f"peak_vs_{args.heads[0]}"] = round(run[peak] / first[peak], 2)
            run[f"time_vs_{args.heads[0]}"] = round(run["step_s"] / first["step_s"], 2)
    result = {"model": args.model, "device": baseline["device"], "dtype": baseline["dtype"], "groups": args.groups,
              "pack_groups": args.pack_groups,
              "group": f"{args.group} completions x {args.tokens} tokens, prompt 64", "runs": runs}
    name = "micro_batches" if args.groups == 1 else f"micro_batches-{args.model}-{args.groups}-groups"
    out = write_results(f"{name}-heads.json" if len(args.heads) > 1 else f"{name}.json", result)
    print(out.read_text())


if __name__ == "__main__":
    main()
