"""Benchmark: the two sampler engines on the same model, same machine, same run. For each,
generation throughput (one engine call of `prompts` groups of `group` completions, `tokens` new
tokens at most, the sampler's call) and the time to swap in a new policy version (load_weights of
a published LoRA adapter: what a sampler does per version). Rounds alternate between the engines,
so both see the same load on a shared machine.

    .venv-vllm/bin/python bench/engines.py [--model smollm2] [--rounds 3]   (needs vLLM: make test-vllm)

Writes bench/results/engines.json; the speed is also given as vLLM's ratio to transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_results
from echo.config import LoraConfig, ModelConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.engines.vllm import VLLMEngine
from echo.policy import weights_shards


def new_version(hf: HFEngine, seed: int, scale: float = 0.02) -> list[bytearray]:
    """A new policy version in hf's model (its trained tensors moved at random), as published."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    return [bytearray(s) for s in weights_shards(hf.model, 2**30)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    sampling = SamplingConfig(group_size=args.group, max_new_tokens=args.tokens, temperature=0.7)
    lora = LoraConfig()
    started = time.perf_counter()
    hf = HFEngine(args.model, lora, sampling, "cpu", "float32")
    hf_start = time.perf_counter() - started
    started = time.perf_counter()
    vllm = VLLMEngine(ModelConfig(name=args.model, device="cpu", dtype="float32"), lora, sampling)
    vllm_start = time.perf_counter() - started
    engines = {"hf": hf, "vllm": vllm}
    prompts = [hf.encode_chat([{"role": "user", "content": f"What is {i} + {i + 3}? Explain."}])
               for i in range(args.prompts)]
    samples: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "swap_s": []} for name in engines}
    for round_ in range(args.rounds + 1):  # round 0 warms both up (first-call costs) and is not counted
        shards = new_version(hf, seed=round_)
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.load_weights(shards)
            swap = time.perf_counter() - started
            started = time.perf_counter()
            groups = engine.generate(prompts, args.group)
            seconds = time.perf_counter() - started
            if round_:
                tokens = sum(len(g.token_ids) for group in groups for g in group)
                samples[name]["tokens_per_s"].append(tokens / seconds)
                samples[name]["swap_s"].append(swap)
    result = {
        "model": args.model,
        "call": f"{args.prompts} prompts x {args.group} completions x {args.tokens} tokens, fp32, CPU, LoRA r={lora.r}",
        "adapter_mb": round(sum(len(s) for s in shards) / 2**20, 2),
        "start_s": {"hf": round(hf_start, 1), "vllm": round(vllm_start, 1)},
        **{name: {k: round(statistics.median(v), 4) for k, v in s.items()} for name, s in samples.items()},
        "rounds": args.rounds,
    }
    result["vllm_speed_ratio"] = round(result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
    out = write_results("engines.json", result)
    print(out.read_text())


if __name__ == "__main__":
    main()
