"""One GRPO optimizer step on a batch of rollout groups. Compute only; the trainer does the I/O."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

import torch

from echo.algorithms.grpo import ImportanceStats, LossStats, grpo_loss, group_advantages, importance_weights
from echo.config import EchoConfig
from echo.devices import autocast, model_device
from echo.policy import group_logprobs
from echo.protocol import RolloutGroup


class StepAbandoned(Exception):
    """The step was told to stop before its optimizer update: the policy is as it was."""


class GroupStats(NamedTuple):
    tokens: int
    sequences: int
    loss: LossStats
    importance: ImportanceStats
    entropy: float


def micro_batches(prompt_len: int, lengths: list[int], budget: int) -> list[list[int]]:
    """A group's completions (by index, in order) packed into forwards of at most `budget`
    tokens: the shared prompt once plus each row padded to the longest in its forward. A
    completion that alone exceeds the budget gets a forward of its own. budget 0: one forward."""
    if budget <= 0:
        return [list(range(len(lengths)))]
    batches, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and prompt_len + (len(current) + 1) * max(longest, n) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    return batches + [current]


def train_step(policy, optimizer, batch: list[tuple[RolloutGroup, list[float]]], cfg: EchoConfig, pad_id: int,
               stop: threading.Event | None = None, compute_dtype: torch.dtype = torch.float32,
               normalizer: int | None = None) -> dict:
    """One optimizer step over (group, rewards) pairs. The loss is the token mean over the whole
    batch; each group is forwarded and backpropagated on its own, or in micro-batches of its
    completions under `trainer.micro_batch_tokens` (gradients accumulate: the same step, in less
    memory). `stop`, set from another thread, abandons the step between groups (StepAbandoned):
    a trainer told to stop does not finish a long step first.

    One step per batch means the policy before the step, pi_old, is the current one: the PPO
    ratio pi / pi_old starts at 1 and the off-policy gap to the sampler's mu is corrected by
    truncated importance weights pi_old / mu.

    The forward runs in `compute_dtype` (autocast) over fp32 trainable parameters; log-probs,
    importance weights and the loss are fp32."""
    tcfg, temperature = cfg.trainer, cfg.sampling.temperature
    device = model_device(policy)
    total_tokens = sum(len(c.token_ids) for g, _ in batch for c in g.completions)
    normalizer = normalizer or total_tokens  # a rank's share of a step divides by the whole step's tokens
    started = time.perf_counter()
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    per_batch, loss_sum = [], 0.0
    for done, (group, rewards) in enumerate(batch):
        if stop is not None and stop.is_set():
            optimizer.zero_grad(set_to_none=True)
            raise StepAbandoned(f"{done} of {len(batch)} groups done")
        completions = [c.token_ids for c in group.completions]
        advantages = group_advantages(torch.tensor(rewards, device=device))  # over the whole group
        behaviour = torch.zeros((len(completions), max(map(len, completions))))
        for i, c in enumerate(group.completions):
            behaviour[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
        behaviour = behaviour.to(device)
        prompt = group.prompt_token_ids
        for rows in micro_batches(len(prompt), list(map(len, completions)), tcfg.micro_batch_tokens):
            part = [completions[i] for i in rows]
            ref_logprobs = None
            with autocast(device, compute_dtype):
                if tcfg.kl_coef > 0:
                    # The reference is the base model: the same weights with the adapter switched off.
                    with torch.no_grad(), policy.disable_adapter():
                        ref_logprobs, _, _ = group_logprobs(policy, prompt, part, temperature, pad_id)
                logprobs, mask, entropy = group_logprobs(policy, prompt, part, temperature, pad_id)
            old_logprobs = logprobs.detach()
            weights, is_stats = importance_weights(old_logprobs, behaviour[rows, : logprobs.shape[1]], mask,
                                                   tcfg.is_cap, tcfg.is_level)
            loss, loss_stats = grpo_loss(logprobs, old_logprobs, advantages[rows], mask, tcfg.clip_eps, normalizer,
                                         weights, ref_logprobs, tcfg.kl_coef)
            loss.backward()
            loss_sum += loss.item()
            per_batch.append(GroupStats(int(mask.sum()), len(rows), loss_stats, is_stats, float(entropy[mask].mean())))
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], tcfg.max_grad_norm)
    optimizer.step()
    policy.eval()

    def token_mean(value) -> float:
        return sum(g.tokens * value(g) for g in per_batch) / max(total_tokens, 1)

    rewards = torch.tensor([r for _, rs in batch for r in rs])
    return {
        "loss": loss_sum,
        "kl": token_mean(lambda g: g.loss.kl),
        "clip_fraction": token_mean(lambda g: g.loss.clip_fraction),
        "entropy": token_mean(lambda g: g.entropy),
        "is_ratio_mean": token_mean(lambda g: g.importance.ratio_mean),
        "is_ratio_max": max(g.importance.ratio_max for g in per_batch),
        "is_truncated_fraction": token_mean(lambda g: g.importance.truncated_fraction),
        "is_masked_fraction": sum(g.importance.masked_fraction * g.sequences for g in per_batch)
        / sum(g.sequences for g in per_batch),
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
