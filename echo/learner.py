"""One GRPO optimizer step on a batch of rollout groups. Compute only; the trainer does the I/O."""

from __future__ import annotations

import contextlib
import time

import torch

from echo.algorithms.grpo import grpo_loss, group_advantages
from echo.config import EchoConfig
from echo.policy import group_logprobs
from echo.protocol import RolloutGroup


def train_step(policy, optimizer, groups: list[RolloutGroup], cfg: EchoConfig, pad_id: int) -> dict:
    """One optimizer step over all groups: the loss is the token mean over the whole batch, and
    each group is forwarded and backpropagated on its own (a group is the unit of memory)."""
    tcfg, temperature = cfg.trainer, cfg.sampling.temperature
    total_tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    started = time.perf_counter()
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    stats, loss_sum = [], 0.0
    for group in groups:
        completions = [c.token_ids for c in group.completions]
        advantages = group_advantages(torch.tensor([c.reward for c in group.completions]))
        behaviour = torch.zeros((len(completions), max(map(len, completions))))
        for i, c in enumerate(group.completions):
            behaviour[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
        ref_logprobs = None
        if tcfg.kl_coef > 0:
            # The reference is the base model: the same weights with the adapter switched off.
            with torch.no_grad(), policy.disable_adapter():
                ref_logprobs, _ = group_logprobs(policy, group.prompt_token_ids, completions, temperature, pad_id)
        logprobs, mask = group_logprobs(policy, group.prompt_token_ids, completions, temperature, pad_id)
        loss, s = grpo_loss(logprobs, behaviour, advantages, mask, tcfg.clip_eps, total_tokens, ref_logprobs, tcfg.kl_coef)
        loss.backward()
        loss_sum += loss.item()
        stats.append((int(mask.sum()), s))
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], tcfg.max_grad_norm)
    optimizer.step()
    policy.eval()

    def token_mean(field: str) -> float:
        return sum(n * getattr(s, field) for n, s in stats) / max(total_tokens, 1)

    rewards = torch.tensor([c.reward for g in groups for c in g.completions])
    return {
        "loss": loss_sum,
        "kl": token_mean("kl"),
        "ratio_mean": token_mean("ratio_mean"),
        "ratio_max": max(s.ratio_max for _, s in stats),
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
