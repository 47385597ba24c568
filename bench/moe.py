"""The training-inference mismatch of a mixture of experts, with and without routing replay
(issue 68), on the tiny MoE (Qwen3-MoE, 8 experts, top-2): the sampler in bf16, the trainer in
fp32, the same weights.

The sampler draws `--groups` groups of 4 completions of up to `--tokens` tokens (temperature 1);
its log-probs (mu) and its routing are those of its bf16 forward over each sampled sequence (the
log-probs a sampler reports, taken over the whole sequence rather than token by token). The
trainer's fp32 forward over the same sequences gives pi, once routing by itself and once
replaying the sampler's routing for every token (echo/trust/routing.py). For each:
- the share of (token, MoE layer) whose top-k set differs from the sampler's;
- the mismatch KL(mu || pi) over the sampled tokens (k3, and k1);
- the token importance ratios pi/mu: the largest, and the share past the cap (2, verl's
  rollout_is_threshold); and the same for GSPO's sequence ratio (the geometric mean a sequence).
And the routing gap (echo/trust/routing.py::routing_gap) of the sampler's honest choices under the
trainer's fp32 router logits, the margin a forged-routing check must allow, beside the gap of
forged choices (random experts for every token), each under the trainer's forward replaying the
choices claimed: how many of those the margin catches.

    python -m bench.moe [--groups 64] [--tokens 64] [--seed 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext

import orjson
import torch

from bench.common import results_dir, write_results
from echo.model.devices import model_device
from echo.model.loading import encode_chat, load_model
from echo.model.policy import make_policy
from echo.trust.routing import recorded, replayed, routers, routing_gap

CAP = 2.0  # the importance weights' cap: verl's rollout_is_threshold, echo-rl's default


def sample(model, tokenizer, prompts: list[list[int]], group: int, tokens: int, seed: int) -> list[list[int]]:
    """Each prompt's group of completions, drawn by the model (the sampler's)."""
    torch.manual_seed(seed)
    sequences = []
    for prompt in prompts:
        ids = torch.tensor([prompt] * group, device=model_device(model))
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id)
        sequences += [row.tolist() for row in out]
    return sequences


def forward(model, sequence: list[int], routing=None):
    """Log-probs of each token after the first, and each router's logits and choices, one sequence."""
    ids = torch.tensor([sequence], device=model_device(model))
    logits_seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: logits_seen.append(out[0].detach().float().cpu()))
             for r in routers(model)]
    try:
        with torch.no_grad(), recorded(model) as calls, (replayed(model, routing) if routing else nullcontext()):
            logits = model(input_ids=ids).logits.float()[0, :-1]
    finally:
        for hook in hooks:
            hook.remove()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs.cpu(), logits_seen, [layer[0] for layer in calls]


def mismatch(mu: list[torch.Tensor], pi: list[torch.Tensor], theirs: list, ours: list) -> dict:
    """The figures of one way of scoring, over every completion (tokens after the prompt)."""
    diff = torch.cat([p - m for p, m in zip(pi, mu)])
    ratio = diff.exp()
    sequence_ratio = torch.stack([(p - m).mean().exp() for p, m in zip(pi, mu)])
    differs = torch.cat([(t.sort(-1).values != o.sort(-1).values).any(-1).float()
                         for seq_t, seq_o in zip(theirs, ours) for t, o in zip(seq_t, seq_o)])
    return {"topk_differs_share": round(differs.mean().item(), 5),
            "mismatch_kl_k3": round((ratio - 1 - diff).mean().item(), 6),
            "mismatch_kl_k1": round((-diff).mean().item(), 6),
            "token_ratio_max": round(ratio.max().item(), 4),
            "token_ratio_min": round(ratio.min().item(), 4),
            "token_truncated_share": round((ratio > CAP).float().mean().item(), 5),
            "sequence_ratio_max": round(sequence_ratio.max().item(), 4),
            "sequence_truncated_share": round((sequence_ratio > CAP).float().mean().item(), 5)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: results in moe-gpu.json")
    args = parser.parse_args(argv)

    from echo.config import LoraConfig

    torch.manual_seed(args.seed)  # the adapter's initialisation and the sampling: one run, one outcome
    trainer, tokenizer = load_model("tiny-moe", args.device, torch.float32)
    trainer = make_policy(trainer, LoraConfig(r=8))
    with torch.no_grad():  # a trained-looking adapter: the policy is not the base model
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    sampler, _ = load_model("tiny-moe", args.device, torch.bfloat16)
    sampler = make_policy(sampler, LoraConfig(r=8))
    sampler.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"What is {i} + {i % 7}?"}])
               for i in range(args.groups)]
    sequences = sample(sampler, tokenizer, prompts, 4, args.tokens, args.seed)
    starts = [len(prompts[i // 4]) - 1 for i in range(len(sequences))]  # logits index of the first completion token

    mu, pi_own, pi_replay, theirs, ours, gaps = [], [], [], [], [], []
    for start, sequence in zip(starts, sequences):
        m, _, chosen = forward(sampler, sequence)
        p, _, own = forward(trainer, sequence)
        # Under replay, each layer's router sees what the claimed choices before it made: the
        # logits the trainer checks a claim against.
        r, router_logits, _ = forward(trainer, sequence, routing=chosen)
        mu.append(m[start:])
        pi_own.append(p[start:])
        pi_replay.append(r[start:])
        theirs.append([c[start + 1 :] for c in chosen])  # the completion tokens' own routing
        ours.append([o[start + 1 :] for o in own])
        gaps.append(torch.cat([routing_gap(lg, c) for lg, c in zip(router_logits, chosen)]))
    honest = torch.cat(gaps)
    margin = honest.max().item()

    # Forged: every token sent to random experts, scored against the trainer's logits under them.
    generator = torch.Generator().manual_seed(args.seed)
    forged_gaps = []
    for sequence in sequences[:32]:
        _, _, own = forward(trainer, sequence)
        fakes = [torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(len(o))]) for o in own]
        _, router_logits, _ = forward(trainer, sequence, routing=fakes)
        forged_gaps += [routing_gap(lg, fake) for lg, fake in zip(router_logits, fakes)]
    forged = torch.cat(forged_gaps)
    tokens = sum(len(m) for m in mu)
    report = {
        "model": "tiny-moe (Qwen3-MoE: 2 layers, 8 experts, top-2), LoRA r=8 with random B (std 0.05)",
        "device": str(model_device(trainer)) if args.device == "cpu" else torch.cuda.get_device_name(),
        "sampler": "bfloat16", "trainer": "float32", "groups": args.groups, "group_size": 4,
        "max_tokens": args.tokens, "completion_tokens": tokens, "seed": args.seed, "cap": CAP,
        "without_replay": mismatch(mu, pi_own, theirs, ours),
        "with_replay": mismatch(mu, pi_replay, theirs, theirs),
        "routing_gap": {
            "honest_max": round(margin, 5),
            "honest_p999": round(torch.quantile(honest, 0.999).item(), 5),
            "honest_nonzero_share": round((honest > 0).float().mean().item(), 5),
            "forged_share_past_honest_max": round((forged > margin).float().mean().item(), 4),
            "forged_share_past_twice_honest_max": round((forged > 2 * margin).float().mean().item(), 4),
            "forged_share_differs_from_own": round((forged > 0).float().mean().item(), 4),
            "note": "logit units of the trainer's fp32 router; a forged choice equal to the own top-k is no forgery",
        },
    }
    name = "moe.json" if args.device == "cpu" else "moe-gpu.json"
    kept = results_dir() / name  # the study's part (bench/moe_study.py) stays
    if kept.exists() and "study" in (old := orjson.loads(kept.read_bytes())):
        report["study"] = old["study"]
    print(write_results(name, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
