"""Benchmark: the sampler engines on the same model, same machine, same run. For each,
generation throughput (one engine call of `prompts` groups of `group` completions, `tokens` new
tokens at most, the sampler's call) and the time to swap in a new policy version (load_weights of
a published LoRA adapter: what a sampler does per version). Rounds alternate between the engines,
so all see the same load on a shared machine. Speeds are also given as ratios to `hf`
(transformers' `generate`), measured in the same run.

    .venv/bin/python -m bench.engines --engines hf hf-paged [--model smollm2] [--rounds 3]
    .venv-vllm/bin/python -m bench.engines --engines hf vllm   (needs vLLM: make test-vllm)
    .venv/bin/python -m bench.engines --engines hf mlx [--model tiny]   (MLX's CPU backend here; Metal on a Mac)
    .venv/bin/python -m bench.engines --engines hf mlx mlx-split --model qwen2-16l   (one model over 2 ranks)

`mlx-split` is the MLX engine split over `--ranks` processes of this box (sampler.ranks: this
process rank 0), with each rank's weights in MB beside the whole model's (what the split buys).
mlx-lm splits qwen2 and qwen3_moe, not llama (SmolLM2): `--model qwen2-16l` is a random-init
Qwen2 of 16 layers (hidden 512, ~60M parameters), built here once, for a split with weight to it.
    python -m bench.engines --engines hf hf-paged --device cuda --dtype bfloat16 --prompts 8 --group 16 --tokens 1024

Writes bench/results/engines[-<engines>-<device>].json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_results
from echo.config import cache_dir, validate_config
from echo.engines import make_engine
from echo.engines.hf import HFEngine
from echo.models import byte_tokenizer
from echo.policy import weights_shards
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"],
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
    model = random_qwen2() if args.model == RANDOM_QWEN2 else args.model
    engines, start_s, ranks = {}, {}, None
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
        engines[name] = make_engine(cfg, group=group)
        if split:
            ranks.engine = engines[name]
        start_s[name] = round(time.perf_counter() - started, 1)
    hf = engines["hf"]
    prompts = [hf.encode_chat([{"role": "user", "content": f"What is {i} + {i + 3}? Explain."}])
               for i in range(args.prompts)]
    samples: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "swap_s": []} for name in engines}
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up (first-call costs) and is not counted
        shards = new_version(hf, seed=round_)
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.load_weights(shards)
            swap = time.perf_counter() - started
            started = time.perf_counter()
            groups = engine.generate(prompts, args.group)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            seconds = time.perf_counter() - started
            if round_:
                tokens = sum(len(g.token_ids) for group in groups for g in group)
                samples[name]["tokens_per_s"].append(tokens / seconds)
                samples[name]["swap_s"].append(swap)
    result = {
        "model": args.model,
        "call": f"{args.prompts} prompts x {args.group} completions x {args.tokens} tokens, {args.dtype}, "
                f"{hf.device}, LoRA r={hf.model.peft_config['default'].r}",
        "adapter_mb": round(sum(len(s) for s in shards) / 2**20, 2),
        "start_s": start_s,
        **{name: {k: round(statistics.median(v), 4) for k, v in s.items()} for name, s in samples.items()},
        "rounds": args.rounds,
    }
    for name in args.engines[1:]:
        result[f"{name}_speed_ratio"] = round(result[name]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
    if ranks is not None:  # what each rank holds, against the whole model in one process
        split = engines["mlx-split"]
        result["mlx-split"]["weights_mb_per_rank"] = [round(mb, 1) for mb in split.rank_mb]
        if "mlx" in engines:
            result["mlx"]["weights_mb"] = round(engines["mlx"].rank_mb[0], 1)
            whole = result["mlx"]["tokens_per_s"]
            result["mlx-split_vs_mlx_speed"] = round(result["mlx-split"]["tokens_per_s"] / whole, 2)
        split.stop_followers()
        ranks.close()
    default = args.engines == ["hf", "vllm"] and args.device == "cpu"  # the figure docs/performance.md quotes
    name = "engines.json" if default else f"engines-{'-'.join(args.engines)}-{hf.device.type}.json"
    out = write_results(name if args.model == "smollm2" else name.replace(".json", f"-{args.model}.json"), result)
    print(out.read_text())


if __name__ == "__main__":
    main()
