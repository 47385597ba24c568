"""Rollout corrections: the off-policy gap between the sampler's policy mu (the version that
sampled, in the engine that sampled) and the trainer's pi_old, corrected as verl's
`algorithm.rollout_correction` names it (docs/algo/rollout_corr.md there). Pure tensor math.

Two stages, each optional:
- importance weights (`rollout_is`): pi_old / mu truncated at a cap, per token (token TIS) or one
  per completion, the product of its tokens' ratios (sequence TIS);
- rejection (`rollout_rs`): weight 0 for tokens (IcePop's two-sided mask) or whole completions
  (MIS: the sequence ratio; geometric: its per-token geometric mean; k3: the completion's mean
  k3 estimate of KL(mu || pi_old)) outside the bounds.
A rejected token keeps its place in the loss's denominator (TRL's token_mask and sequence_mask do
the same): the batch's token count is known before its ratios are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Log-ratios are bounded to +-20 before exp (verl's safety bound): a sequence ratio, the product
# over hundreds of tokens, overflows otherwise.
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    weights: str = "token"  # off, token or sequence
    cap: float = 2.0  # the weights' truncation
    reject: str = "off"  # off, token, sequence, geometric or k3
    low: float = 0.5  # rejection's ratio bounds (token, sequence, geometric)
    high: float = 2.0
    k3_max: float = 0.01  # k3 rejection: a completion's mean k3 above this


@dataclass
class CorrectionStats:
    ratio_mean: float  # pi_old / mu over completion tokens
    ratio_max: float
    truncated_fraction: float  # tokens whose weight was cut to the cap
    masked_fraction: float  # completions rejected whole
    # The train/inference mismatch: KL(mu || pi_old) over the sampled tokens (the k3 estimator,
    # r - 1 - log r): 0 when the trainer computes the log-probs the sampler reported.
    mismatch_kl: float = 0.0
    rejected_tokens: float = 0.0  # tokens given weight 0 by the rejection, whole completions' included


def rollout_correction(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       correction: Correction) -> tuple[torch.Tensor, CorrectionStats]:
    """Per-token weights [B, T] (0 off the mask and where rejected) and the stages' statistics.
    old_logprobs (pi_old), behaviour_logprobs (mu), mask: [B, T]."""
    maskf = mask.to(old_logprobs.dtype)
    log_ratio = ((old_logprobs - behaviour_logprobs) * maskf).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    tokens = maskf.sum(-1)
    sequence_log_ratio = log_ratio.sum(-1)
    if correction.weights == "token":
        weights, truncated = ratio.clamp(max=correction.cap), (ratio > correction.cap) & mask
    elif correction.weights == "sequence":
        sequence_ratio = torch.exp(sequence_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        weights = sequence_ratio.clamp(max=correction.cap).unsqueeze(-1).expand_as(ratio)
        truncated = (sequence_ratio > correction.cap).unsqueeze(-1) & mask
    else:
        weights, truncated = torch.ones_like(ratio), torch.zeros_like(mask)
    keep = torch.ones_like(mask)  # per token
    whole = torch.ones(ratio.shape[0], dtype=torch.bool, device=ratio.device)  # per completion
    if correction.reject == "token":
        keep = (ratio >= correction.low) & (ratio <= correction.high)
    elif correction.reject in ("sequence", "geometric"):
        per_sequence = sequence_log_ratio if correction.reject == "sequence" else sequence_log_ratio / tokens.clamp(min=1)
        per_sequence = torch.exp(per_sequence.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        whole = (per_sequence >= correction.low) & (per_sequence <= correction.high)
    elif correction.reject == "k3":
        k3 = ((ratio - 1 - log_ratio) * maskf).sum(-1) / tokens.clamp(min=1)
        whole = k3 <= correction.k3_max
    keep = keep & whole.unsqueeze(-1)
    weights = weights * keep * maskf
    n = maskf.sum().clamp(min=1.0)
    stats = CorrectionStats(
        ratio_mean=float((ratio * maskf).sum() / n),
        ratio_max=float(ratio[mask].max()) if mask.any() else 1.0,
        truncated_fraction=float(truncated.sum() / n),
        masked_fraction=float((~whole).float().mean()) if whole.numel() else 0.0,
        mismatch_kl=float(((ratio - 1 - log_ratio) * maskf).sum() / n),
        rejected_tokens=float(((~keep) & mask).sum() / n),
    )
    return weights, stats
