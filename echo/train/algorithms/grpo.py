"""GRPO and its variants: advantages, the clipped policy-gradient loss and its aggregation, the
KL estimators. Pure tensor math; rollout corrections are echo/train/algorithms/corrections.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from echo.train.diagnosis import no_signal

# Added to the std an advantage divides by (TRL's GRPOTrainer adds the same): a group whose
# rewards barely differ does not get advantages of thousands.
ADVANTAGE_EPS = 1e-4


def advantages(rewards: list[list[float]], scale: str = "group", eps: float = ADVANTAGE_EPS,
               device=None) -> list[torch.Tensor]:
    """Each group's completions' advantages, in float64 and returned float32: the reward less its
    group's mean, divided by the group's std (scale "group", GRPO), by the whole batch's std
    ("batch", as Dr. GRPO's authors and TRL's scale_rewards="batch"), or not at all ("none",
    Dr. GRPO). Both stds unbiased, as TRL's. A group whose rewards are equal (echo/train/diagnosis.py's
    no_signal) has advantages of exactly zero, whatever the scale."""
    groups = [torch.tensor(r, dtype=torch.float64) for r in rewards]
    flat = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.float64)
    batch_std = flat.std() if flat.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    out = []
    for r in groups:
        if no_signal(r.tolist()):
            out.append(torch.zeros(r.numel(), device=device))
            continue
        centred = r - r.mean()
        divisor = {"group": r.std() + eps, "batch": batch_std + eps, "none": torch.tensor(1.0)}[scale]
        out.append((centred / divisor).float().to(device))
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool = False):
    """Log-prob of each token under softmax(logits / temperature), the distribution sampled from:
    its logit less the row's log-sum-exp (no log-softmax rows are made for the vocabulary's other
    tokens); with_entropy also returns that distribution's entropy at each position (no gradient)."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # fp32 at least
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
class LossStats:
    policy_loss: float  # the policy term's token mean (before aggregation)
    kl: float  # the KL estimate's token mean
    clip_fraction: float  # tokens where the clip was active: clipped below or above
    clip_low_fraction: float = 0.0  # ratio < 1 - clip_low with A < 0 (TRL's clip_ratio/low_mean)
    clip_high_fraction: float = 0.0  # ratio > 1 + clip_high with A > 0 (TRL's clip_ratio/high_mean)


@dataclass(frozen=True)
class Objective:
    """The clipped policy-gradient objective, as TRL's GRPOTrainer names its parts:
    clip_low/clip_high are its epsilon/epsilon_high; ratio_level its importance_sampling_level
    ("sequence": GSPO's length-normalised sequence ratio, one per completion); kl_coef its beta,
    with the KL estimator k1, k2 or k3 (TRL's: k3)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens the policy sampled (Schulman's
    k1, k2, k3): k1 = log(p/q), unbiased, can be negative; k2 = (log(p/q))^2 / 2; k3 = q/p - 1 - log(q/p),
    unbiased and never negative."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) + log_ratio - 1.0


def row_scales(lengths: torch.Tensor, aggregation: str, batch_tokens: int, batch_sequences: int,
               max_tokens: int) -> torch.Tensor:
    """What each completion's summed per-token loss is multiplied by, so that the passes' losses
    add up to the whole batch's: "token_mean" over the batch's tokens (DAPO; TRL's loss_type
    "dapo", and "bnpo" on one batch), "sequence_mean": each completion's token mean, averaged over
    the batch's completions (GRPO as published; TRL's "grpo"), "constant": over completions x
    max_tokens (Dr. GRPO; TRL's "dr_grpo"). lengths: each completion's trained tokens."""
    if aggregation == "token_mean":
        return torch.full_like(lengths, 1.0 / max(batch_tokens, 1), dtype=torch.float32)
    if aggregation == "sequence_mean":
        return 1.0 / (lengths.clamp(min=1).float() * max(batch_sequences, 1))
    return torch.full_like(lengths, 1.0 / (max(batch_sequences, 1) * max_tokens), dtype=torch.float32)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    objective: Objective,
    scales: torch.Tensor,
    weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped objective -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), times the rollout
    correction's `weights`, plus kl_coef times the KL estimate, summed over each completion's
    tokens and times its `scales` (row_scales). r = pi / pi_old, per token or (ratio_level
    "sequence") one per completion: exp of the mean log-ratio over its tokens.

    logprobs, old_logprobs, mask, weights, ref_logprobs: [B, T]; advantages, scales: [B]."""
    maskf = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    if objective.ratio_level == "sequence":
        log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - objective.clip_low, 1.0 + objective.clip_high) * adv
    policy_term = -torch.minimum(unclipped, clipped).expand_as(logprobs)
    per_token = policy_term * weights if weights is not None else policy_term
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and objective.kl_coef > 0:
        kl = kl_estimate(logprobs, ref_logprobs, objective.kl_estimator)
        per_token = per_token + objective.kl_coef * kl
    loss = ((per_token * maskf).sum(-1) * scales).sum()
    with torch.no_grad():
        n = maskf.sum().clamp(min=1.0)
        low = ((ratio < 1.0 - objective.clip_low) & (adv < 0)).expand_as(maskf)
        high = ((ratio > 1.0 + objective.clip_high) & (adv > 0)).expand_as(maskf)
        stats = LossStats(
            policy_loss=float((policy_term * maskf).sum() / n),
            kl=float((kl * maskf).sum() / n),
            clip_fraction=float(((low | high) * maskf).sum() / n),
            clip_low_fraction=float((low * maskf).sum() / n),
            clip_high_fraction=float((high * maskf).sum() / n),
        )
    return loss, stats
