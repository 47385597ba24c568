"""One GRPO optimizer step on a batch of rollout groups. Compute only; the trainer does the I/O."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from echo.algorithms.grpo import ImportanceStats, LossStats, group_advantages, grpo_loss, importance_weights
from echo.config import EchoConfig
from echo.devices import autocast, model_device
from echo.noise import TokenMargins
from echo.policy import packed_states, states_logprobs
from echo.proof import Checked, held_checks, held_noise, worst_checks
from echo.wire.messages import RolloutGroup


class StepAbandoned(Exception):
    """The step was told to stop before its optimizer update: the policy is as it was."""


class ForgedInStep(Exception):
    """The step's own forward proved groups forged (HeldProof): no update was made, the policy is
    as it was; the step is to be taken again without them."""

    def __init__(self, forged: dict[str, str]):
        super().__init__(f"{len(forged)} forged: {sorted(forged.items())[:4]}")
        self.forged = forged  # group id -> why (token_forgery, logprob_forgery)


@dataclass(frozen=True)
class HeldProof:
    """The proof of sampling a step runs from its own forward (echo/proof.py's held_checks) on
    the groups `version`, the one it trains from, sampled: their recomputed log-probs are its
    pi_old, so the check costs the token margins only. `judge` answers, before the optimizer's
    update and alike on every rank, which groups are forged (group id -> why)."""

    version: int
    noise_key: Callable[[RolloutGroup], int | None]  # a group's noise key where its tokens are checked
    judge: Callable[[dict[str, Checked]], dict[str, str]]


class PassStats(NamedTuple):
    tokens: int
    sequences: int
    loss_value: float  # this pass's share of the step's loss
    loss: LossStats
    importance: ImportanceStats
    entropy: float
    checked: dict[str, Checked]  # HeldProof's checks of this pass's groups


# A pass: the completions one forward and backward takes, as (group index, completion rows).
Pass = list[tuple[int, list[int]]]


@dataclass(frozen=True)
class Batch:
    """What one step trains on: the judged groups, each with the trainer's own rewards, and the
    oldest version whose tokens are trained (the staleness bound: a partial rollout's tokens
    sampled before it are left out of the loss)."""

    groups: list[RolloutGroup]
    rewards: list[list[float]]  # per group, per completion: the task's verifier on the trainer
    oldest_version: int = 0
    step: int = 1  # the step it is (1-based): its learning rate follows the schedule

    @classmethod
    def of(cls, scored: list[tuple[RolloutGroup, list[float]]], oldest_version: int = 0, step: int = 1) -> Batch:
        return cls([group for group, _ in scored], [list(rewards) for _, rewards in scored], oldest_version, step)

    @property
    def versions(self) -> list[int]:
        """The version that sampled each group (a partial rollout's first tokens)."""
        return [group.version for group in self.groups]

    def advantages(self, device=None) -> list[torch.Tensor]:
        """Each group's completions' advantages, over its whole group (GRPO)."""
        return [group_advantages(torch.tensor(rewards, device=device)) for rewards in self.rewards]

    def trained_tokens(self) -> int:
        """The completion tokens the loss is over: the model's own, sampled at `oldest_version` or later."""
        return sum(int(c.model_mask()[g.sampled_from(self.oldest_version):].sum())
                   for g in self.groups for c in g.completions)


def micro_batches(groups: list[tuple[int, list[int]]], budget: int, share: bool = True) -> list[Pass]:
    """Completions of (prompt length, completion lengths) groups packed, in order, into passes of
    at most `budget` tokens: each prompt in the pass once, padded to the longest, plus each
    completion padded to the longest. With `share`, completions of several groups share a pass
    (fewer, larger forwards: on a GPU a small model's forward costs its kernel launches, not its
    arithmetic); without, a pass holds one group's. A completion that alone exceeds the budget
    gets a pass of its own. budget 0: a group per pass, however long."""
    if budget <= 0:
        return [[(g, list(range(len(lengths))))] for g, (_, lengths) in enumerate(groups)]
    passes: list[Pass] = []
    current: Pass = []
    prompts = longest_prompt = longest = rows = 0
    for g, (prompt_len, lengths) in enumerate(groups):
        for i, n in enumerate(lengths):
            new_prompt = not current or current[-1][0] != g
            cost = (prompts + new_prompt) * max(longest_prompt, prompt_len) + (rows + 1) * max(longest, n)
            if current and (cost > budget or (new_prompt and not share)):
                passes.append(current)
                current, prompts, longest_prompt, longest, rows = [], 0, 0, 0, 0
            if current and not new_prompt:
                current[-1][1].append(i)
            else:
                current.append((g, [i]))
                prompts += 1
            longest_prompt, longest, rows = max(longest_prompt, prompt_len), max(longest, n), rows + 1
    return passes + [current]


def step_passes(batch: Batch, budget: int, share: bool = True) -> list[Pass]:
    """A step's forward/backward passes, in order."""
    return micro_batches([(len(group.prompt_token_ids), [len(c.token_ids) for c in group.completions])
                          for group in batch.groups], budget, share)


def shares_passes(pack_groups: str, device: torch.device) -> bool:
    """`trainer.pack_groups`: auto packs on a GPU, where it saves launches; on a CPU the forward
    is arithmetic-bound and a larger pass only costs memory (bench/micro_batches.py)."""
    return device.type == "cuda" if pack_groups == "auto" else pack_groups == "on"


def rank_passes(passes: list, rank: int, world: int) -> list:
    """This rank's share of a step's passes (every world-th), padded with None (an empty pass) to
    the same count on every rank: on a sharded model each forward and backward is a collective,
    so every rank must run as many, shaped alike."""
    mine = passes[rank::world]
    return mine + [None] * (-(-len(passes) // world) - len(mine))


def train_step(model, optimizer, batch: Batch, cfg: EchoConfig, pad_id: int, stop: threading.Event | None = None,
               compute_dtype: torch.dtype = torch.float32, rank: int = 0, world: int = 1,
               held: HeldProof | None = None) -> dict:
    """One optimizer step over a batch of judged groups. The loss is the token mean over the whole
    batch; its completions are forwarded and backpropagated in passes of at most
    `trainer.micro_batch_tokens` tokens, several short groups in one pass or a long group over
    several (gradients accumulate: the same step, in fewer launches or less memory), or a group
    a pass with the budget 0. `stop`, set from another thread, abandons the step between passes
    (StepAbandoned): a trainer told to stop does not finish a long step first.

    On `world` ranks (a sharded model) each rank runs its share of the passes; their gradients
    add up to the whole step's (each pass divides by the whole batch's tokens). The statistics
    are this rank's: merge_stats combines the ranks'.

    One step per batch means the policy before the step, pi_old, is the current one: the PPO
    ratio pi / pi_old starts at 1 and the off-policy gap to the sampler's mu is corrected by
    truncated importance weights pi_old / mu. So the groups sampled by the current version are
    proved from the same forward (`held`): before the update, and if any is forged none is made
    (ForgedInStep).

    The forward runs in `compute_dtype` (autocast) over fp32 trainable parameters; log-probs,
    importance weights and the loss are fp32.

    A partial rollout's tokens sampled with a version older than `batch.oldest_version` (the
    staleness bound) are left out of the loss: the bound holds for every token trained, while
    the newer rest of a long completion is not thrown away with them. So are a multi-turn
    episode's observations (the environment's tokens): the loss, importance weights and KL are
    over the model's tokens only; the advantage is the episode's, over its group."""
    tcfg = cfg.trainer
    device = model_device(model)
    total_tokens, advantages = batch.trained_tokens(), batch.advantages(device)
    passes = rank_passes(step_passes(batch, tcfg.micro_batch_tokens, shares_passes(tcfg.pack_groups, device)), rank, world)
    started = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    per_pass, loss_sum = [], 0.0
    for done, this in enumerate(passes):
        if stop is not None and stop.is_set():
            optimizer.zero_grad(set_to_none=True)
            raise StepAbandoned(f"{done} of {len(passes)} passes done")
        if this is None:
            _empty_pass(model, cfg, pad_id, device, compute_dtype)
            continue
        segments = [(batch.groups[g], advantages[g][rows], rows) for g, rows in this]
        stats = _pass(model, cfg, pad_id, device, compute_dtype, segments, total_tokens, batch.oldest_version, held)
        loss_sum += stats.loss_value
        per_pass.append(stats)
    if held is not None:
        forged = held.judge(worst_checks(stats.checked for stats in per_pass))
        if forged:
            optimizer.zero_grad(set_to_none=True)
            model.eval()
            raise ForgedInStep(forged)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], tcfg.max_grad_norm)
    lr = learning_rate(cfg, batch.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    model.eval()

    tokens, sequences = sum(g.tokens for g in per_pass), sum(g.sequences for g in per_pass)

    def token_mean(value) -> float:
        return sum(g.tokens * value(g) for g in per_pass) / max(tokens, 1)

    rewards = torch.tensor([r for rs in batch.rewards for r in rs])
    return {
        "loss": loss_sum,
        "kl": token_mean(lambda g: g.loss.kl),
        "clip_fraction": token_mean(lambda g: g.loss.clip_fraction),
        "entropy": token_mean(lambda g: g.entropy),
        "is_ratio_mean": token_mean(lambda g: g.importance.ratio_mean),
        "is_ratio_max": max((g.importance.ratio_max for g in per_pass), default=0.0),
        "is_truncated_fraction": token_mean(lambda g: g.importance.truncated_fraction),
        "is_masked_fraction": sum(g.importance.masked_fraction * g.sequences for g in per_pass) / max(sequences, 1),
        "mismatch_kl": token_mean(lambda g: g.importance.mismatch_kl),
        "grad_norm": float(grad_norm),
        "lr": lr,
        "reward_mean": float(rewards.mean()),  # the whole batch's, on every rank
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "tokens": tokens,
        "sequences": sequences,
        "passes": len(per_pass),
        "train_seconds": time.perf_counter() - started,
    }


TOKEN_MEANS = ("kl", "clip_fraction", "entropy", "is_ratio_mean", "is_truncated_fraction", "mismatch_kl")


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
        "passes": sum(p["passes"] for p in parts),
        "train_seconds": max(p["train_seconds"] for p in parts),
    }


def _pass(model, cfg: EchoConfig, pad_id: int, device, compute_dtype,
          segments: list[tuple[RolloutGroup, torch.Tensor, list[int]]], normalizer: int, oldest_version: int,
          held: HeldProof | None = None) -> PassStats:
    """Forward and backward over some completions of some groups: (group, the rows' advantages,
    rows) each; the advantages are over each whole group, whichever of its completions this pass takes."""
    tcfg = cfg.trainer
    prompts = [group.prompt_token_ids for group, _, _ in segments]
    claimed = [group.completions[i] for group, _, rows in segments for i in rows]
    owners = [j for j, (_, _, rows) in enumerate(segments) for _ in rows]
    advantages = torch.cat([rows_advantages for _, rows_advantages, _ in segments])
    pass_groups = [(group, rows) for group, _, rows in segments]
    margins = None  # the held version's token margins, from the logits the log-probs are made of
    noise = [] if held is None else held_noise(pass_groups, held.version, held.noise_key)
    if any(n is not None for n in noise):
        margins = TokenMargins(noise, [torch.from_numpy(c.model_mask()) for c in claimed], cfg.sampling.temperature,
                               device)
    logprobs, mask, entropy, ref_logprobs = _forward(model, cfg, pad_id, device, compute_dtype, prompts,
                                                     [c.token_ids for c in claimed], owners, margins)
    checked = {} if held is None else held_checks(pass_groups, logprobs.detach(), margins, held.version)
    behaviour, sampled = torch.zeros(logprobs.shape), torch.zeros(mask.shape, dtype=torch.bool)
    for i, completion in enumerate(claimed):
        behaviour[i, : len(completion.logprobs)] = torch.tensor(completion.logprobs)
        sampled[i, : len(completion.token_ids)] = torch.from_numpy(completion.model_mask())
    mask = mask & sampled.to(mask.device)  # an episode's observations are the environment's: never trained
    stale = [group.sampled_from(oldest_version) for group, _, rows in segments for _ in rows]
    if any(stale):
        mask = mask & (torch.arange(mask.shape[1], device=mask.device) >= torch.tensor(stale, device=mask.device)[:, None])
    old_logprobs = logprobs.detach()
    weights, is_stats = importance_weights(old_logprobs, behaviour.to(device), mask, tcfg.is_cap, tcfg.is_level)
    loss, loss_stats = grpo_loss(logprobs, old_logprobs, advantages, mask, tcfg.clip_eps, normalizer, weights,
                                 ref_logprobs, tcfg.kl_coef)
    loss.backward()
    return PassStats(int(mask.sum()), len(claimed), loss.item(), loss_stats, is_stats,
                     float(entropy[mask].mean()) if mask.any() else 0.0, checked)


def _forward(model, cfg: EchoConfig, pad_id: int, device, compute_dtype, prompts: list, completions: list,
             owners: list[int], observe=None):
    """Log-probs, mask and entropy of completions, and the reference's log-probs (KL on);
    `observe` sees the policy's logits as they are made (policy.states_logprobs). Every pass
    calls the model alike (a reference forward with KL on; at least two completion positions, so
    a prompt call and a completion call): see rank_passes."""
    temperature, ref_logprobs = cfg.sampling.temperature, None
    with autocast(device, compute_dtype):
        if cfg.trainer.kl_coef > 0:
            # The reference is the base model: the same weights with the adapter switched off.
            with torch.no_grad(), model.disable_adapter():
                states, ids, _ = packed_states(model, prompts, completions, owners, pad_id, min_length=2)
                ref_logprobs = states_logprobs(model, states, ids, temperature)
        states, ids, mask = packed_states(model, prompts, completions, owners, pad_id, min_length=2)
        logprobs, entropy = states_logprobs(model, states, ids, temperature, with_entropy=True, observe=observe)
    return logprobs, mask, entropy, ref_logprobs


def _empty_pass(model, cfg: EchoConfig, pad_id: int, device, compute_dtype) -> None:
    """A pass shaped like a real one whose gradient is zero: a rank with fewer passes than
    another still joins every collective of theirs."""
    logprobs, *_ = _forward(model, cfg, pad_id, device, compute_dtype, [[pad_id]], [[pad_id]], [0])
    (logprobs.sum() * 0.0).backward()


def learning_rate(cfg: EchoConfig, step: int) -> float:
    """Step `step`'s learning rate (1-based, of run.steps): transformers' schedules with warmup,
    which count the optimizer steps taken before this one."""
    tcfg, taken = cfg.trainer, step - 1
    if taken < tcfg.warmup_steps:
        return tcfg.lr * taken / max(1, tcfg.warmup_steps)
    progress = (taken - tcfg.warmup_steps) / max(1, cfg.run.steps - tcfg.warmup_steps)
    factor = {"constant": 1.0, "linear": max(0.0, 1.0 - progress),
              "cosine": max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))}[tcfg.lr_schedule]
    return tcfg.lr * factor


def make_optimizer(model, cfg: EchoConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(1)
