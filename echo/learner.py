"""One GRPO optimizer step on a batch of rollout groups. Compute only; the trainer does the I/O."""

from __future__ import annotations

import contextlib
import time

import torch

from echo.algorithms.grpo import grpo_loss, group_advantages
from echo.config import EchoConfig
from echo.policy import make_batch, sequence_logprobs
from echo.protocol import RolloutGroup


def train_step(policy, optimizer, groups: list[RolloutGroup], cfg: EchoConfig, pad_id: int) -> dict:
    tcfg = cfg.trainer
    sequences, advantages = [], []
    for group in groups:
        rewards = torch.tensor([c.reward for c in group.completions])
        advantages.append(group_advantages(rewards))
        sequences += [(group.prompt_token_ids, c.token_ids, c.logprobs) for c in group.completions]
    advantages = torch.cat(advantages)
    total_tokens = sum(len(c) for _, c, _ in sequences)

    started = time.perf_counter()
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    stats = []
    for start in range(0, len(sequences), tcfg.micro_batch):
        batch = make_batch(sequences[start : start + tcfg.micro_batch], pad_id)
        ref_logprobs = None
        if tcfg.kl_coef > 0:
            # The reference is the base model: the same weights with the adapter switched off.
            with torch.no_grad(), policy.disable_adapter():
                ref_logprobs = sequence_logprobs(policy, batch, cfg.sampling.temperature)
        logprobs = sequence_logprobs(policy, batch, cfg.sampling.temperature)
        loss, s = grpo_loss(
            logprobs,
            batch.behaviour_logprobs,
            advantages[start : start + tcfg.micro_batch],
            batch.completion_mask,
            clip_eps=tcfg.clip_eps,
            normalizer=total_tokens,
            ref_logprobs=ref_logprobs,
            kl_coef=tcfg.kl_coef,
        )
        loss.backward()
        stats.append((batch.num_tokens, s, loss.item()))
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in policy.parameters() if p.requires_grad], tcfg.max_grad_norm
    )
    optimizer.step()
    policy.eval()

    def token_mean(field: str) -> float:
        return sum(n * getattr(s, field) for n, s, _ in stats) / max(total_tokens, 1)

    rewards = torch.tensor([c.reward for g in groups for c in g.completions])
    return {
        "loss": sum(loss for _, _, loss in stats),
        "kl": token_mean("kl"),
        "ratio_mean": token_mean("ratio_mean"),
        "ratio_max": max(s.ratio_max for _, s, _ in stats),
        "clip_fraction": token_mean("clip_fraction"),
        "grad_norm": float(grad_norm),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "tokens": total_tokens,
        "train_seconds": time.perf_counter() - started,
    }


def make_optimizer(policy, cfg: EchoConfig) -> torch.optim.Optimizer:
    params = [p for p in policy.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(1)
