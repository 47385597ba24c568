"""Benchmark: proof of sampling's honest gap and its false-positive rate.

An honest sampler (the transformers engine) generates groups with a LoRA adapter at version 0;
the trainer's SamplingProof recomputes their log-probs, once as the trainer's newest version and
once after the trainer has moved on to version 1 (the version-0 adapter swapped in). The largest
per-token gap of each group is recorded; the false-positive rate is the share of honest groups
above `trainer.verify_tolerance`. Forged groups (log-probs shifted by a little) show what the
tolerance still catches.

    .venv/bin/python -m bench.proof_of_sampling [--models tiny smollm2] [--groups 24]

Writes bench/results/proof_of_sampling.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from bench.common import write_results
from echo.config import LoraConfig, SamplingConfig, TaskConfig, TrainerConfig
from echo.engines.hf import HFEngine
from echo.policy import load_weights, weights_shards
from echo.proof import ProofSettings, SamplingProof
from echo.tasks import load_task
from echo.wire.messages import Completion, RolloutGroup

FORGERY_SHIFTS = [0.5, 0.1, 0.02]  # nats subtracted from every claimed log-prob


def perturb_adapter(model, seed: int, scale: float) -> None:
    """A trained-looking adapter: lora_B is zero at init, which would make every version the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def honest_groups(engine: HFEngine, task, count: int, group_size: int, prompts_per_call: int) -> list[RolloutGroup]:
    groups = []
    for start in range(0, count, prompts_per_call):
        prompts = [task.prompt(i) for i in range(start, min(count, start + prompts_per_call))]
        ids = [engine.encode_chat(p.messages) for p in prompts]
        for prompt, prompt_ids, gens in zip(prompts, ids, engine.generate(ids, group_size)):
            completions = [Completion(token_ids=g.token_ids, logprobs=g.logprobs, text=g.text, reward=0.0,
                                      finish_reason=g.finish_reason) for g in gens]
            groups.append(RolloutGroup(group_id=f"g{prompt.index}", sampler_id="honest", version=0,
                                       task=task.name, prompt_index=prompt.index, slot=1, epoch=0, prompt_token_ids=prompt_ids,
                                       completions=completions, temperature=engine.temperature, engine="hf",
                                       dtype="float32", gen_seconds=0.0, created_at=0.0))
    return groups


def forged(group: RolloutGroup, shift: float) -> RolloutGroup:
    completions = [c.replaced(logprobs=np.minimum(c.logprobs - shift, 0.0)) for c in group.completions]
    return group.model_copy(update={"completions": completions, "sampler_id": f"forger{shift}"})


def measure(model_name: str, count: int, tolerance: float) -> dict:
    sampling = SamplingConfig(group_size=8, max_new_tokens=32, temperature=0.7, prompts_per_call=4)
    lora = LoraConfig(r=16, alpha=32.0)
    engine = HFEngine(model_name, lora, sampling)  # the sampler
    trainer = HFEngine(model_name, lora, sampling).model  # the trainer's policy: another instance
    perturb_adapter(engine.model, seed=0, scale=0.02)
    load_weights(trainer, [bytearray(s) for s in weights_shards(engine.model, 2**30)])  # version 0, as published
    task = load_task(TaskConfig())
    started = time.perf_counter()
    groups = honest_groups(engine, task, count, sampling.group_size, sampling.prompts_per_call)
    generate_seconds = time.perf_counter() - started

    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id,
                          ProofSettings(sampling.temperature, fraction=1.0, tolerance=tolerance, keep=2))
    proof.remember(0)
    started = time.perf_counter()
    current = [proof.check(g).gap for g in groups]
    check_seconds = time.perf_counter() - started
    perturb_adapter(trainer, seed=1, scale=0.02)  # the trainer takes a step: version 1
    proof.remember(1)
    stale = [proof.check(g).gap for g in groups]  # version 0 swapped in for each, then 1 back
    honest = current + stale

    def caught_at(shift: float) -> float:
        fakes = [forged(g, shift) for g in groups]
        return sum(proof.forged(f, proof.check(f)) is not None for f in fakes) / len(fakes)

    caught = {str(shift): caught_at(shift) for shift in FORGERY_SHIFTS}
    return {
        "model": model_name,
        "groups": len(groups),
        "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
        "honest_gap_max": max(honest),
        "honest_gap_median": statistics.median(honest),
        "honest_gap_p99": sorted(honest)[int(0.99 * (len(honest) - 1))],
        "false_positive_rate": sum(gap > tolerance for gap in honest) / len(honest),
        "forgeries_caught": caught,  # by shift in nats
        "check_seconds_per_group": check_seconds / len(groups),
        "generate_seconds_per_group": generate_seconds / len(groups),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--groups", type=int, default=24, help="honest groups per model, each checked twice")
    args = parser.parse_args()
    torch.manual_seed(0)
    tolerance = TrainerConfig().verify_tolerance
    results = {
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "tolerance": tolerance,
        "results": [measure(m, args.groups, tolerance) for m in args.models],
    }
    out = write_results("proof_of_sampling.json", results)
    print(out.read_text())


if __name__ == "__main__":
    main()
