"""Benchmark: the sampler engines on the same model, same machine, same run. For each,
generation throughput (one engine call of `prompts` groups of `group` completions, `tokens` new
tokens at most, the sampler's call) and the time to swap in a new policy version (load_weights of
a published LoRA adapter: what a sampler does per version). Rounds alternate between the engines,
so all see the same load on a shared machine. Speeds are also given as ratios to `hf`
(transformers' `generate`), measured in the same run.

    .venv/bin/python -m bench.engines   (hf, mlx and mlx-split on tiny, smollm2 and qwen2-16l: engines.json)
    .venv/bin/python -m bench.engines --engines hf hf-paged [--model smollm2] [--rounds 3]
    .venv-vllm/bin/python -m bench.engines --engines hf vllm --model smollm2   (needs vLLM: make test-vllm)
    python -m bench.engines --engines hf hf-paged --model smollm2 --device cuda --dtype bfloat16 \
        --prompts 8 --group 16 --tokens 1024

`mlx` is MLX's CPU backend here (Metal on a Mac). `mlx-split` is the MLX engine split over
`--ranks` processes of this box (sampler.ranks: this process rank 0). For both, each rank's
weights in MB and its peak: the weights and the most a call took above what the rank held before
it (mx.get_peak_memory, read on every rank), what the split buys. mlx-lm splits qwen2 and
qwen3_moe, not llama (SmolLM2: its row says so); `qwen2-16l` is a random-init Qwen2 of 16 layers
(hidden 512, ~60M parameters), built here once, for a split with weight to it. Several models:
each runs in a process of its own (one MLX group a process), into one file.

Writes bench/results/engines[-<engines>-<device>[-<models>]].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

from bench.common import write_results
from echo.config import ConfigError, cache_dir, validate_config
from echo.engines import make_engine
from echo.engines.hf import HFEngine
from echo.model.loading import byte_tokenizer
from echo.weights.shards import weights_shards
from workers.sampler.ranks import start_ranks

RANDOM_QWEN2 = "qwen2-16l"


def random_qwen2() -> str:
    """A random-init Qwen2 of 16 layers as a model folder (built once, in the cache): a dense model
    mlx-lm can split, larger than the tiny one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = cache_dir() / f"bench-{RANDOM_QWEN2}"
    if not (folder / "config.json").exists():
        tokenizer = byte_tokenizer()
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def new_version(hf: HFEngine, seed: int, scale: float = 0.02) -> list[bytearray]:
    """A new policy version in hf's model (its trained tensors moved at random), as published."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.model.parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=generator) * scale).to(p.device, p.dtype))  # drawn on the CPU: the same version on any device
    return [bytearray(s) for s in weights_shards(hf.model, 2**30)]


DEFAULT_ENGINES, DEFAULT_MODELS = ["hf", "mlx", "mlx-split"], ["tiny", "smollm2", RANDOM_QWEN2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="+", default=DEFAULT_MODELS,
                        help="several: each in a process of its own (one MLX group a process), one file")
    parser.add_argument("--engines", nargs="+", default=DEFAULT_ENGINES,
                        choices=["hf", "hf-paged", "vllm", "mlx", "mlx-split"],
                        help="sampler.engine settings, hf first: the others' speeds are ratios to it")
    parser.add_argument("--ranks", type=int, default=2, help="mlx-split: the processes one model is split over")
    parser.add_argument("--device", default="cpu", help="model.device")
    parser.add_argument("--dtype", default="float32", help="model.dtype")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if args.engines[0] != "hf":
        parser.error("--engines: hf first (the baseline)")
    name = f"engines-{'-'.join(args.engines)}-{args.device.split(':')[0]}"
    if args.engines == DEFAULT_ENGINES and args.model == DEFAULT_MODELS and args.device == "cpu":
        name = "engines"  # the figures docs/operations.md quotes
    elif args.model != ["smollm2"]:
        name += f"-{'-'.join(args.model)}"
    if len(args.model) == 1:
        result = measure(args, args.model[0])
    else:
        result = {"call": None, "models": {}}
        for model in args.model:
            with tempfile.TemporaryDirectory() as folder:
                argv = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("model", "engines")]
                subprocess.run([sys.executable, "-m", "bench.engines", *argv, "--engines", *args.engines,
                                "--model", model], check=True, env={**os.environ, "BENCH_RESULTS": folder})
                [child] = Path(folder).glob("*.json")
                one = orjson.loads(child.read_bytes())
            result["call"] = one.pop("call")
            result["models"][model] = one  # with the load while this model's rounds ran
    out = write_results(f"{name}.json", result)
    print(out.read_text())


def measure(args, model_name: str) -> dict:
    """One model's engines, rounds alternating between them."""
    model = random_qwen2() if model_name == RANDOM_QWEN2 else model_name
    engines, start_s, refused, ranks = {}, {}, {}, None
    for name in args.engines:
        split = name == "mlx-split"
        cfg = validate_config({"model": {"name": model, "device": args.device, "dtype": args.dtype},
                               "sampling": {"group_size": args.group, "max_new_tokens": args.tokens, "temperature": 0.7,
                                            "dtypes": ["float32", "bfloat16", "float16"],  # speed, not the proof
                                            "noise": "engine"},  # each engine's own sampling
                               "sampler": {"engine": "mlx" if split else name, "ranks": args.ranks if split else 1}})
        started = time.perf_counter()
        group = None
        if split:
            group, ranks = start_ranks(cfg, on_lost=lambda why: print(f"a rank was lost: {why}"))
        try:
            engines[name] = make_engine(cfg, group=group)
        except ConfigError as e:  # mlx-lm splits no llama (SmolLM2): said in the row
            refused[name] = str(e)
            if split:
                ranks.close()
                ranks = None
            continue
        if split:
            ranks.engine = engines[name]
        start_s[name] = round(time.perf_counter() - started, 1)
    hf = engines["hf"]
    prompts = [hf.encode_chat([{"role": "user", "content": f"What is {i} + {i + 3}? Explain."}])
               for i in range(args.prompts)]
    samples: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "swap_s": []} for name in engines}
    call_mb: dict[str, list[float]] = {}  # an MLX engine's most memory a call took above what it held, by rank
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up (first-call costs) and is not counted
        shards = new_version(hf, seed=round_)
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.load_weights(shards)
            swap = time.perf_counter() - started
            before = engine.memory_mb() if hasattr(engine, "memory_mb") else None
            started = time.perf_counter()
            groups = engine.generate(prompts, args.group)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            seconds = time.perf_counter() - started
            if before is not None:
                took = [most - held for (held, _), (_, most) in zip(before, engine.memory_mb())]
                call_mb[name] = [max(a, b) for a, b in zip(call_mb.get(name, took), took)]
            if round_:
                tokens = sum(len(g.token_ids) for group in groups for g in group)
                samples[name]["tokens_per_s"].append(tokens / seconds)
                samples[name]["swap_s"].append(swap)
    result = {
        "model": model_name,
        "call": f"{args.prompts} prompts x {args.group} completions x {args.tokens} tokens, {args.dtype}, "
                f"{hf.device}, LoRA r={hf.model.peft_config['default'].r}",
        "adapter_mb": round(sum(len(s) for s in shards) / 2**20, 2),
        "start_s": start_s,
        **{name: {k: round(statistics.median(v), 4) for k, v in s.items()} for name, s in samples.items()},
        **{name: {"refused": why} for name, why in refused.items()},
        "rounds": args.rounds,
    }
    for name in engines:
        if name != "hf":
            result[f"{name}_speed_ratio"] = round(result[name]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
        if name in call_mb:  # each rank's weights, and its peak: the weights and the most a call took above them
            held = engines[name].rank_mb
            result[name]["weights_mb_per_rank"] = [round(mb, 1) for mb in held]
            result[name]["peak_mb_per_rank"] = [round(mb + extra, 1) for mb, extra in zip(held, call_mb[name])]
    if "mlx" in engines and "mlx-split" in engines:
        result["mlx-split_vs_mlx_speed"] = round(result["mlx-split"]["tokens_per_s"] / result["mlx"]["tokens_per_s"], 2)
    if ranks is not None:
        engines["mlx-split"].stop_followers()
        ranks.close()
    return result


if __name__ == "__main__":
    main()
