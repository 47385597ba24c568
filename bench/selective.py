"""Benchmark: what selective delivery still buys a sampler (issue 80).

A sampler that lets the groups it dislikes go (under the 1-in-8 bound, trainer.undelivered_share)
forges nothing: the trainer grants each such prompt again. Before, the prompt came back on a new
slot, drawn with that slot's keyed noise: a fresh draw, so the dropper chose which of a prompt's
draws were trained. Now it comes back with the noise of the slot it was first granted on
(echo/fleet/grants.py): the same draw, moved only by the versions the trainer took meanwhile.

The tiny model, keyed noise, `--prompts` groups drawn at version 0. The statistic the dropper
selects on: how often a chosen token appears in a group's completions (any token the policy
emits often; a length or a phrase is the same game). The dropper lets go of the eighth of its
groups lowest in it; each is drawn again at version 1 (the adapter nudged by `--step`, several
optimizer steps' worth), with the first slot's noise (now) or a new slot's (before). Recorded:
the statistic's mean over what is trained, honest and dropper, the bias in the honest groups'
standard errors, and the share of redrawn completions identical to the dropped ones.

    .venv/bin/python -m bench.selective [--prompts 256] [--step 0.001]

Writes bench/results/selective.json (with the machine's load).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bench.common import write_results
from bench.proof import SEED, perturb_adapter
from echo.config import LoraConfig, SamplingConfig, TaskConfig
from echo.engines.hf import HFEngine
from echo.fleet.grants import DeliveryBound
from echo.tasks import load_task
from echo.trust.noise import Draw, group_key


def draw(engine: HFEngine, prompt_ids: list, slots: list[int], group_size: int, batch: int = 8) -> list[list[list[int]]]:
    """Each prompt's completions, drawn with the keyed noise of its slot."""
    out = []
    for start in range(0, len(prompt_ids), batch):
        draws = [Draw(group_key(SEED, 0, slot)) for slot in slots[start : start + batch]]
        for gens in engine.generate(prompt_ids[start : start + batch], group_size, draws=draws):
            out.append([list(g.token_ids) for g in gens])
    return out


def share_of(token: int, group: list[list[int]]) -> float:
    """The statistic: the share of a group's completion tokens that are `token`."""
    return sum(c.count(token) for c in group) / sum(len(c) for c in group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--step", type=float, default=0.001, help="how far version 1's adapter moves from version 0's")
    args = parser.parse_args()
    sampling = SamplingConfig(group_size=8, max_new_tokens=16, temperature=1.0)
    engine = HFEngine("tiny", LoraConfig(r=8, alpha=16.0), sampling, "cpu", "float32")
    perturb_adapter(engine.model, seed=0, scale=0.05)
    task = load_task(TaskConfig())
    prompt_ids = [engine.encode_chat(task.prompt(i).messages) for i in range(args.prompts)]
    slots = list(range(1, args.prompts + 1))
    first = draw(engine, prompt_ids, slots, sampling.group_size)
    token = max(range(256), key=lambda t: sum(c.count(t) for g in first for c in g))  # one it emits often
    stats = [share_of(token, g) for g in first]
    dropped = sorted(range(args.prompts), key=stats.__getitem__)[: int(DeliveryBound().share * args.prompts)]

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # version 1: the trainer stepped on meanwhile
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=generator) * args.step)
    again = [prompt_ids[i] for i in dropped]
    same_noise = draw(engine, again, [slots[i] for i in dropped], sampling.group_size)
    new_noise = draw(engine, again, [args.prompts + 1 + k for k in range(len(dropped))], sampling.group_size)

    def trained_mean(redrawn: list[list[list[int]]]) -> float:
        kept = dict(enumerate(stats))
        kept.update((i, share_of(token, g)) for i, g in zip(dropped, redrawn))
        return statistics.fmean(kept.values())

    honest = statistics.fmean(stats)
    stderr = statistics.stdev(stats) / math.sqrt(len(stats))
    same, new = trained_mean(same_noise), trained_mean(new_noise)
    identical = sum(a == b for i, g in zip(dropped, same_noise) for a, b in zip(first[i], g))
    result = {
        "model": "tiny", "prompts": args.prompts, "group_size": sampling.group_size,
        "max_new_tokens": sampling.max_new_tokens, "dropped": len(dropped), "version_step": args.step,
        "statistic": f"share of token {token} in a group's completions", "honest_mean": honest,
        "honest_standard_error": stderr,
        "dropper_same_noise_mean": same, "dropper_new_noise_mean": new,
        "bias_same_noise_in_standard_errors": round((same - honest) / stderr, 3),
        "bias_new_noise_in_standard_errors": round((new - honest) / stderr, 3),
        "redrawn_completions_identical_share": identical / (len(dropped) * sampling.group_size),
    }
    print(write_results("selective.json", result).read_text())


if __name__ == "__main__":
    main()
