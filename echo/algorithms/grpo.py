"""GRPO: group-normalised advantages and the clipped policy-gradient loss. Pure tensor math."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each completion relative to its group: (r - mean) / std.
    A group whose rewards are all equal carries no signal and gets zero advantage."""
    centered = rewards - rewards.mean()
    if norm_std and rewards.numel() > 1:
        centered = centered / (rewards.std() + eps)
    return centered


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-prob of each token under softmax(logits / temperature), the distribution sampled from."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossStats:
    policy_loss: float
    kl: float
    ratio_mean: float
    ratio_max: float
    clip_fraction: float


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip objective with per-sequence advantages, summed over completion tokens and divided
    by `normalizer` (the batch's token count), so micro-batch losses add up to a token mean.

    logprobs, behaviour_logprobs, mask: [B, T]; advantages: [B]; ref_logprobs: [B, T] or None.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(policy || reference): non-negative, unbiased, low variance.
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum() / normalizer
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        stats = LossStats(
            policy_loss=float((-torch.minimum(unclipped, clipped) * mask).sum() / n),
            kl=float((kl * mask).sum() / n),
            ratio_mean=float((ratio * mask).sum() / n),
            ratio_max=float((ratio * mask).max()) if mask.any() else 1.0,
            clip_fraction=float(((unclipped != clipped).to(mask.dtype) * mask).sum() / n),
        )
    return loss, stats
