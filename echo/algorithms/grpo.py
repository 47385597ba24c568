"""GRPO: group-normalised advantages and the clipped policy-gradient loss. Pure tensor math."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# Rewards whose spread is below this are equal: what differs is float rounding, not signal.
# (8 float32 rewards of 0.1 have a mean that is not 0.1 and a std of ~1e-8: divided by it, every
# completion got -0.0074, and a batch with no signal moved the adapter by a full Adam step.)
EQUAL_REWARDS_STD = 1e-6


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each completion relative to its group: (r - mean) / std, in float64.
    A group whose rewards are equal (within EQUAL_REWARDS_STD) carries no signal: zero."""
    r = rewards.double()
    if r.numel() < 2 or r.std() <= EQUAL_REWARDS_STD:
        return torch.zeros_like(rewards)
    return ((r - r.mean()) / (r.std() + eps)).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool = False):
    """Log-prob of each token under softmax(logits / temperature), the distribution sampled from:
    its logit less the row's log-sum-exp (no log-softmax rows are made for the vocabulary's other
    tokens); with_entropy also returns that distribution's entropy at each position (no gradient)."""
    scaled = logits.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return chosen
    with torch.no_grad():
        entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return chosen, entropy


# fp32 logits a head_logprobs chunk holds at once (256 MB): 1,365 positions of a 49k vocabulary.
HEAD_CHUNK_ELEMENTS = 2**26


def head_logprobs(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool = False,
                  observe=None):
    """token_logprobs(head(hidden), tokens, ...) without ever holding a pass's full-vocabulary
    logits: a chunk of positions at a time, each chunk's logits dropped once its log-probs are
    taken and made again in the backward (activation checkpointing: one more matmul of the head
    instead of keeping [tokens x vocabulary] fp32 for the backward: 0.8 GB at 4,096 tokens of
    a 49k vocabulary). hidden [..., H] is what the head reads at each position; tokens [...].
    `observe(rows, positions, tokens, logits)`, if given, sees each chunk's logits once (detached),
    as made for the log-probs, with where they stand in tokens [R, C] and the tokens there."""
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    chunk = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad
    observed: set[int] = set()

    def part(h: torch.Tensor, t: torch.Tensor, start: int):
        logits = head(h)
        if observe is not None and start not in observed:  # not again when the backward makes it anew
            observed.add(start)
            flat = torch.arange(start, start + len(t), device=t.device)
            with torch.no_grad():
                observe(flat // tokens.shape[-1], flat % tokens.shape[-1], t, logits.detach())
        return token_logprobs(logits, t, temperature, with_entropy)

    parts = [checkpoint(part, flat_hidden[i : i + chunk], flat_tokens[i : i + chunk], i, use_reentrant=False)
             if recompute else part(flat_hidden[i : i + chunk], flat_tokens[i : i + chunk], i)
             for i in range(0, flat_tokens.numel(), chunk)]
    if not with_entropy:
        return torch.cat(parts).view(tokens.shape)
    return torch.cat([p for p, _ in parts]).view(tokens.shape), torch.cat([e for _, e in parts]).view(tokens.shape)


@dataclass
class ImportanceStats:
    ratio_mean: float  # pi_old / mu over completion tokens
    ratio_max: float
    truncated_fraction: float  # tokens whose ratio was cut to the cap
    masked_fraction: float  # sequences left out by the sequence-level mask
    # The train/inference mismatch: KL(mu || pi_old) over the sampled tokens (the k3 estimator,
    # r - 1 - log r): 0 when the trainer computes the log-probs the sampler reported.
    mismatch_kl: float = 0.0


def importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float, level: str
) -> tuple[torch.Tensor, ImportanceStats]:
    """Truncated importance weights [B, T] correcting for rollouts sampled by an older policy mu.

    token: w_t = min(pi_old(t) / mu(t), cap).
    sequence: the same, and a sequence whose geometric-mean ratio lies outside [1/cap, cap] is
    masked out entirely (its tokens get weight 0): too far off-policy to learn from.
    off: every token weight 1 (no correction), the ratios' statistics measured all the same.
    """
    maskf = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - behaviour_logprobs) * maskf
    ratio = torch.exp(log_ratio)
    corrected = level != "off"
    weights = (torch.clamp(ratio, max=cap) if corrected else torch.ones_like(ratio)) * maskf
    keep = torch.ones(ratio.shape[0], dtype=torch.bool, device=ratio.device)
    if level == "sequence":
        mean_log_ratio = log_ratio.sum(-1) / maskf.sum(-1).clamp(min=1.0)
        keep = mean_log_ratio.abs() <= math.log(cap)
        weights = weights * keep.unsqueeze(-1)
    n = maskf.sum().clamp(min=1.0)
    stats = ImportanceStats(
        ratio_mean=float((ratio * maskf).sum() / n),
        ratio_max=float(ratio[mask].max()) if mask.any() else 1.0,
        truncated_fraction=float(((ratio > cap) & mask).sum() / n) if corrected else 0.0,
        masked_fraction=float((~keep).float().mean()),
        mismatch_kl=float(((ratio - 1 - log_ratio) * maskf).sum() / n),
    )
    return weights, stats


@dataclass
class LossStats:
    policy_loss: float
    kl: float
    clip_fraction: float  # tokens where the PPO clip was active


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normalizer: float,
    weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip objective with per-sequence advantages and optional per-token importance
    weights, summed over completion tokens and divided by `normalizer` (the batch's token
    count), so per-group losses add up to a token mean over the batch.

    logprobs, old_logprobs, mask, weights, ref_logprobs: [B, T]; advantages: [B].
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    policy_term = -torch.minimum(unclipped, clipped)
    if weights is not None:
        policy_term = policy_term * weights
    per_token = policy_term
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
            policy_loss=float((policy_term * mask).sum() / n),
            kl=float((kl * mask).sum() / n),
            clip_fraction=float(((unclipped != clipped).to(mask.dtype) * mask).sum() / n),
        )
    return loss, stats
