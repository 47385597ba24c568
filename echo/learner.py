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


class PassStats(NamedTuple):
    tokens: int
    sequences: int
    loss_value: float  # this pass's share of the step's loss
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


def step_passes(batch: list[tuple[RolloutGroup, list[float]]], budget: int) -> list[tuple[int, list[int]]]:
    """A step's forward/backward passes, in order: (group index, completion rows) per micro-batch."""
    return [(g, rows) for g, (group, _) in enumerate(batch)
            for rows in micro_batches(len(group.prompt_token_ids), [len(c.token_ids) for c in group.completions], budget)]


def rank_passes(passes: list, rank: int, world: int) -> list:
    """This rank's share of a step's passes (every world-th), padded with None (an empty pass) to
    the same count on every rank: on a sharded model each forward and backward is a collective,
    so every rank must run as many, shaped alike."""
    mine = passes[rank::world]
    return mine + [None] * (-(-len(passes) // world) - len(mine))


def train_step(policy, optimizer, batch: list[tuple[RolloutGroup, list[float]]], cfg: EchoConfig, pad_id: int,
               stop: threading.Event | None = None, compute_dtype: torch.dtype = torch.float32,
               rank: int = 0, world: int = 1) -> dict:
    """One optimizer step over (group, rewards) pairs. The loss is the token mean over the whole
    batch; each group is forwarded and backpropagated on its own, or in micro-batches of its
    completions under `trainer.micro_batch_tokens` (gradients accumulate: the same step, in less
    memory). `stop`, set from another thread, abandons the step between passes (StepAbandoned):
    a trainer told to stop does not finish a long step first.

    On `world` ranks (a sharded model) each rank runs its share of the passes; their gradients
    add up to the whole step's (each pass divides by the whole batch's tokens). The statistics
    are this rank's: merge_stats combines the ranks'.

    One step per batch means the policy before the step, pi_old, is the current one: the PPO
    ratio pi / pi_old starts at 1 and the off-policy gap to the sampler's mu is corrected by
    truncated importance weights pi_old / mu.

    The forward runs in `compute_dtype` (autocast) over fp32 trainable parameters; log-probs,
    importance weights and the loss are fp32."""
    tcfg = cfg.trainer
    device = model_device(policy)
    total_tokens = sum(len(c.token_ids) for g, _ in batch for c in g.completions)
    passes = rank_passes(step_passes(batch, tcfg.micro_batch_tokens), rank, world)
    started = time.perf_counter()
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    per_pass, loss_sum = [], 0.0
    for done, this in enumerate(passes):
        if stop is not None and stop.is_set():
            optimizer.zero_grad(set_to_none=True)
            raise StepAbandoned(f"{done} of {len(passes)} passes done")
        if this is None:
            _empty_pass(policy, cfg, pad_id, device, compute_dtype)
            continue
        group, rewards = batch[this[0]]
        stats = _pass(policy, cfg, pad_id, device, compute_dtype, group, rewards, this[1], total_tokens)
        loss_sum += stats.loss_value
        per_pass.append(stats)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], tcfg.max_grad_norm)
    optimizer.step()
    policy.eval()

    tokens, sequences = sum(g.tokens for g in per_pass), sum(g.sequences for g in per_pass)

    def token_mean(value) -> float:
        return sum(g.tokens * value(g) for g in per_pass) / max(tokens, 1)

    rewards = torch.tensor([r for _, rs in batch for r in rs])
    return {
        "loss": loss_sum,
        "kl": token_mean(lambda g: g.loss.kl),
        "clip_fraction": token_mean(lambda g: g.loss.clip_fraction),
        "entropy": token_mean(lambda g: g.entropy),
        "is_ratio_mean": token_mean(lambda g: g.importance.ratio_mean),
        "is_ratio_max": max((g.importance.ratio_max for g in per_pass), default=0.0),
        "is_truncated_fraction": token_mean(lambda g: g.importance.truncated_fraction),
        "is_masked_fraction": sum(g.importance.masked_fraction * g.sequences for g in per_pass) / max(sequences, 1),
        "grad_norm": float(grad_norm),
        "reward_mean": float(rewards.mean()),  # the whole batch's, on every rank
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "tokens": tokens,
        "sequences": sequences,
        "train_seconds": time.perf_counter() - started,
    }


TOKEN_MEANS = ("kl", "clip_fraction", "entropy", "is_ratio_mean", "is_truncated_fraction")


def merge_stats(parts: list[dict]) -> dict:
    """The whole step's statistics from each rank's train_step statistics."""
    tokens, sequences = sum(p["tokens"] for p in parts), sum(p["sequences"] for p in parts)
    return {
        **parts[0],  # the same on every rank: grad_norm, reward_mean, reward_std
        **{k: sum(p[k] * p["tokens"] for p in parts) / max(tokens, 1) for k in TOKEN_MEANS},
        "is_masked_fraction": sum(p["is_masked_fraction"] * p["sequences"] for p in parts) / max(sequences, 1),
        "is_ratio_max": max(p["is_ratio_max"] for p in parts),
        "loss": sum(p["loss"] for p in parts),
        "tokens": tokens,
        "sequences": sequences,
        "train_seconds": max(p["train_seconds"] for p in parts),
    }


def _pass(policy, cfg: EchoConfig, pad_id: int, device, compute_dtype, group: RolloutGroup, rewards: list[float],
          rows: list[int], normalizer: int) -> PassStats:
    """Forward and backward over some of a group's completions (all share its prompt)."""
    tcfg = cfg.trainer
    completions = [group.completions[i].token_ids for i in rows]
    advantages = group_advantages(torch.tensor(rewards, device=device))[rows]  # over the whole group
    logprobs, mask, entropy, ref_logprobs = _forward(policy, cfg, pad_id, device, compute_dtype,
                                                     group.prompt_token_ids, completions)
    behaviour = torch.zeros(logprobs.shape)
    for i, row in enumerate(rows):
        claimed = group.completions[row].logprobs
        behaviour[i, : len(claimed)] = torch.tensor(claimed)
    old_logprobs = logprobs.detach()
    weights, is_stats = importance_weights(old_logprobs, behaviour.to(device), mask, tcfg.is_cap, tcfg.is_level)
    loss, loss_stats = grpo_loss(logprobs, old_logprobs, advantages, mask, tcfg.clip_eps, normalizer, weights,
                                 ref_logprobs, tcfg.kl_coef)
    loss.backward()
    return PassStats(int(mask.sum()), len(rows), loss.item(), loss_stats, is_stats, float(entropy[mask].mean()))


def _forward(policy, cfg: EchoConfig, pad_id: int, device, compute_dtype, prompt, completions: list):
    """Log-probs, mask and entropy of completions, and the reference's log-probs (KL on). Every
    pass calls the model alike (a reference forward with KL on; at least two completion
    positions, so a prompt call and a completion call): see rank_passes."""
    temperature, ref_logprobs = cfg.sampling.temperature, None
    with autocast(device, compute_dtype):
        if cfg.trainer.kl_coef > 0:
            # The reference is the base model: the same weights with the adapter switched off.
            with torch.no_grad(), policy.disable_adapter():
                ref_logprobs, _, _ = group_logprobs(policy, prompt, completions, temperature, pad_id, min_length=2)
        logprobs, mask, entropy = group_logprobs(policy, prompt, completions, temperature, pad_id, min_length=2)
    return logprobs, mask, entropy, ref_logprobs


def _empty_pass(policy, cfg: EchoConfig, pad_id: int, device, compute_dtype) -> None:
    """A pass shaped like a real one whose gradient is zero: a rank with fewer passes than
    another still joins every collective of theirs."""
    logprobs, _, _, ref_logprobs = _forward(policy, cfg, pad_id, device, compute_dtype, [pad_id], [[pad_id]])
    (logprobs.sum() * 0.0).backward()


def make_optimizer(policy, cfg: EchoConfig) -> torch.optim.Optimizer:
    params = [p for p in policy.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(1)
