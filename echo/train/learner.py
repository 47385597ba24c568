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

from echo.config import EchoConfig
from echo.model.devices import autocast, model_device
from echo.model.policy import packed_states, states_logprobs
from echo.train.algorithms.corrections import Correction, CorrectionStats, rollout_correction
from echo.train.algorithms.grpo import LossStats, Objective, advantages, policy_loss, row_scales
from echo.trust.noise import TokenMargins
from echo.trust.proof import Checked, held_checks, held_noise, worst_checks
from echo.trust.routing import RoutingReplay
from echo.wire.messages import RolloutGroup


class StepAbandoned(Exception):
    """The step was told to stop before its optimizer update: the policy is as it was."""


class ForgedInStep(Exception):
    """The step's own forward proved groups forged (HeldProof): no update was made, the policy is
    as it was; the step is to be taken again without them."""

    def __init__(self, forged: dict[str, str]):
        super().__init__(f"{len(forged)} forged: {sorted(forged.items())[:4]}")
        self.forged = forged  # group id -> why (token_forgery, forged_routing, logprob_forgery)


@dataclass(frozen=True)
class HeldProof:
    """The proof of sampling a step runs from its own forward (echo/trust/proof.py's held_checks) on
    the groups `version`, the one it trains from, sampled: their recomputed log-probs are its
    pi_old, so the check costs the token margins only. A hook on the first iteration's passes:
    `observer` watches a pass's logits as they are made, `checks` reads the pass after its forward,
    and `judge` answers, before the optimizer's update and alike on every rank, which groups are
    forged (group id -> why). The step knows nothing else of the proof."""

    version: int
    noise_key: Callable[[RolloutGroup], int | None]  # a group's noise key where its tokens are checked
    judge: Callable[[dict[str, Checked]], dict[str, str]]

    def observer(self, pass_groups: list[tuple[RolloutGroup, list[int]]], claimed: list, temperature: float,
                 device) -> TokenMargins | None:
        """The token margins of the pass's rows this version sampled with keyed noise (None: none)."""
        noise = held_noise(pass_groups, self.version, self.noise_key)
        if not any(n is not None for n in noise):
            return None
        return TokenMargins(noise, [torch.from_numpy(c.model_mask()) for c in claimed], temperature, device)

    def checks(self, pass_groups: list[tuple[RolloutGroup, list[int]]], recomputed: torch.Tensor,
               margins: TokenMargins | None, replay: RoutingReplay | None) -> dict[str, Checked]:
        return held_checks(pass_groups, recomputed, margins, self.version, replay)


class PassStats(NamedTuple):
    tokens: int
    sequences: int
    loss_value: float  # this pass's share of the step's loss
    loss: LossStats
    importance: CorrectionStats
    entropy: float
    checked: dict[str, Checked]  # HeldProof's checks of this pass's groups


@dataclass(frozen=True)
class Frozen:
    """What a pass's first iteration fixes for the batch's later ones (algorithm.num_iterations):
    pi_old's log-probs, the trained mask, the rollout correction's weights (pi_old / mu) and
    statistics, and the reference's log-probs (KL on)."""

    old_logprobs: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    importance: CorrectionStats
    ref_logprobs: torch.Tensor | None


# A pass: the completions one forward and backward takes, as (group index, completion rows).
Pass = list[tuple[int, list[int]]]


@dataclass
class Rewarded:
    """A group with the trainer's own rewards: the one record a group is from the judge
    (workers/trainer/judge.py's Accepted is one) to the learner. Never the sampler's claims."""

    group: RolloutGroup
    rewards: list[float]  # per completion: the task's verifier on the trainer
    content: str = ""  # its content_hash where the judge took it (none for a bench's or a retrain's)


@dataclass(frozen=True)
class Batch:
    """What one step trains on: the judged groups, each with the trainer's own rewards, and the
    oldest version whose tokens are trained (the staleness bound: a partial rollout's tokens
    sampled before it are left out of the loss)."""

    groups: list[Rewarded]
    oldest_version: int = 0
    step: int = 1  # the step it is (1-based): its learning rate follows the schedule

    @property
    def versions(self) -> list[int]:
        """The version that sampled each group (a partial rollout's first tokens)."""
        return [r.group.version for r in self.groups]

    def advantages(self, scale: str = "group", device=None) -> list[torch.Tensor]:
        """Each group's completions' advantages, over its whole group (GRPO), scaled by `scale`'s std."""
        return advantages([r.rewards for r in self.groups], scale, device=device)

    def trained_tokens(self, mask_truncated: bool = False) -> int:
        """The completion tokens the loss is over: the model's own, sampled at `oldest_version` or
        later, of completions that stopped by themselves where `mask_truncated`."""
        return sum(int(c.model_mask()[r.group.sampled_from(self.oldest_version):].sum())
                   for r in self.groups for c in r.group.completions
                   if not (mask_truncated and c.truncated))

    @property
    def sequences(self) -> int:
        return sum(len(r.group.completions) for r in self.groups)


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
    return micro_batches([(len(r.group.prompt_token_ids), [len(c.token_ids) for c in r.group.completions])
                          for r in batch.groups], budget, share)


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


@dataclass(frozen=True)
class Forward:
    """How a trainer forwards its policy: the model, the run's config, the pad token, and the
    device and dtype it computes in (autocast over fp32 trainable parameters)."""

    model: torch.nn.Module
    cfg: EchoConfig
    pad_id: int
    device: torch.device
    compute_dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: EchoConfig, pad_id: int, compute_dtype: torch.dtype = torch.float32):
        """On the device the model's parameters are on."""
        return cls(model, cfg, pad_id, model_device(model), compute_dtype)

    def __call__(self, prompts: list, completions: list, owners: list[int], observe=None, reference: bool = True,
                 replay: RoutingReplay | None = None):
        """Log-probs, mask and entropy of completions, and the reference's log-probs (KL on, and
        `reference`: a batch's later iterations reuse the first's); `observe` sees the policy's
        logits as they are made (policy.states_logprobs); `replay` routes a mixture of experts'
        tokens as sampled (the reference's too) and measures the policy's routing gaps. Every pass
        calls the model alike (a reference forward with KL on, in the first iteration; at least two
        completion positions, so a prompt call and a completion call): see rank_passes."""
        model, temperature, ref_logprobs = self.model, self.cfg.sampling.temperature, None
        with autocast(self.device, self.compute_dtype):
            if self.cfg.algorithm.kl_coef > 0 and reference:
                # The reference is the base model: the same weights with the adapter switched off.
                again = replay and replay.again()  # routed alike; its gaps are not the policy's
                with torch.no_grad(), model.disable_adapter():
                    states, ids, _ = packed_states(model, prompts, completions, owners, self.pad_id, 2, again)
                    ref_logprobs = states_logprobs(model, states, ids, temperature)
            states, ids, mask = packed_states(model, prompts, completions, owners, self.pad_id, 2, replay)
            logprobs, entropy = states_logprobs(model, states, ids, temperature, with_entropy=True, observe=observe)
        return logprobs, mask, entropy, ref_logprobs

    def empty_pass(self, reference: bool = True) -> None:
        """A pass shaped like a real one whose gradient is zero: a rank with fewer passes than
        another still joins every collective of theirs."""
        logprobs, *_ = self([[self.pad_id]], [[self.pad_id]], [0], reference=reference)
        (logprobs.sum() * 0.0).backward()


def train_step(forward: Forward, optimizer, batch: Batch, stop: threading.Event | None = None, rank: int = 0,
               world: int = 1, held: HeldProof | None = None) -> dict:
    """`algorithm.num_iterations` optimizer steps over a batch of judged groups. The loss
    aggregates as `algorithm.loss_aggregation` says over the whole batch; its completions are
    forwarded and backpropagated in passes of at most `trainer.micro_batch_tokens` tokens, several
    short groups in one pass or a long group over several (gradients accumulate: the same step,
    in fewer launches or less memory), or a group a pass with the budget 0. `stop`, set from
    another thread, abandons the step between passes (StepAbandoned): a trainer told to stop does
    not finish a long step first (after its first update the policy is part-trained: the process
    is stopping, and its checkpoint holds the step before).

    On `world` ranks (a sharded model) each rank runs its share of the passes; their gradients
    add up to the whole step's (each pass scales by the whole batch's counts). The statistics
    are this rank's: merge_stats combines the ranks'.

    The policy before the step is pi_old: the first iteration's forward gives its log-probs, the
    PPO ratio pi / pi_old starts at 1 and acts from the second iteration on (Frozen keeps what the
    first fixed). The off-policy gap to the sampler's mu is the rollout correction's (pi_old / mu,
    echo/train/algorithms/corrections.py). So the groups sampled by the current version are proved from
    the first forward (`held`): before any update, and if any is forged none is made (ForgedInStep).

    The forward runs in its `compute_dtype` (autocast) over fp32 trainable parameters; log-probs,
    importance weights and the loss are fp32.

    A partial rollout's tokens sampled with a version older than `batch.oldest_version` (the
    staleness bound) are left out of the loss: the bound holds for every token trained, while
    the newer rest of a long completion is not thrown away with them. So are a multi-turn
    episode's observations (the environment's tokens): the loss, importance weights and KL are
    over the model's tokens only; the advantage is the episode's, over its group."""
    model, cfg, device = forward.model, forward.cfg, forward.device
    tcfg, acfg = cfg.trainer, cfg.algorithm
    counts = (batch.trained_tokens(acfg.mask_truncated), batch.sequences)
    advantages = batch.advantages(acfg.scale_rewards, device)
    passes = rank_passes(step_passes(batch, tcfg.micro_batch_tokens, shares_passes(tcfg.pack_groups, device)), rank, world)
    started = time.perf_counter()
    model.train()
    frozen: dict[int, Frozen] = {}
    iterations: list[list[PassStats]] = []
    losses, grad_norms = [], []
    lr = learning_rate(cfg, batch.step)
    for iteration in range(acfg.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        per_pass, loss_sum = [], 0.0
        for done, this in enumerate(passes):
            if stop is not None and stop.is_set():
                optimizer.zero_grad(set_to_none=True)
                raise StepAbandoned(f"iteration {iteration + 1}: {done} of {len(passes)} passes done")
            if this is None:
                forward.empty_pass(reference=iteration == 0)
                continue
            segments = [(batch.groups[g].group, advantages[g][rows], rows) for g, rows in this]
            stats, fixed = _pass(forward, segments, counts, batch.oldest_version,
                                 held if iteration == 0 else None, frozen.get(done))
            if acfg.num_iterations > 1:  # kept on the device for the later iterations only
                frozen[done] = fixed
            loss_sum += stats.loss_value
            per_pass.append(stats)
        if held is not None and iteration == 0:
            forged = held.judge(worst_checks(stats.checked for stats in per_pass))
            if forged:
                optimizer.zero_grad(set_to_none=True)
                model.eval()
                raise ForgedInStep(forged)
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, tcfg.max_grad_norm)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        iterations.append(per_pass)
        losses.append(loss_sum)
    model.eval()
    return step_stats(iterations, losses, grad_norms, lr, batch, time.perf_counter() - started)


def step_stats(iterations: list[list[PassStats]], losses: list[float], grad_norms: list[float], lr: float,
               batch: Batch, seconds: float) -> dict:
    """The step's statistics: the rollout correction's from the first iteration (the only one that
    computes it), the loss and the clip's averaged over the iterations (as TRL logs them), the last
    iteration's gradient norm."""
    first, every = iterations[0], [stats for per_pass in iterations for stats in per_pass]
    tokens, sequences = sum(g.tokens for g in first), sum(g.sequences for g in first)

    def token_mean(passes: list[PassStats], value) -> float:
        return sum(g.tokens * value(g) for g in passes) / max(sum(g.tokens for g in passes), 1)

    rewards = torch.tensor([reward for r in batch.groups for reward in r.rewards])
    return {
        "loss": sum(losses) / len(losses),
        "kl": token_mean(every, lambda g: g.loss.kl),
        "clip_fraction": token_mean(every, lambda g: g.loss.clip_fraction),
        "clip_low_fraction": token_mean(every, lambda g: g.loss.clip_low_fraction),
        "clip_high_fraction": token_mean(every, lambda g: g.loss.clip_high_fraction),
        "entropy": token_mean(first, lambda g: g.entropy),
        "is_ratio_mean": token_mean(first, lambda g: g.importance.ratio_mean),
        "is_ratio_max": max((g.importance.ratio_max for g in first), default=0.0),
        "is_truncated_fraction": token_mean(first, lambda g: g.importance.truncated_fraction),
        "is_masked_fraction": sum(g.importance.masked_fraction * g.sequences for g in first) / max(sequences, 1),
        "rs_rejected_tokens": token_mean(first, lambda g: g.importance.rejected_tokens),
        "mismatch_kl": token_mean(first, lambda g: g.importance.mismatch_kl),
        "grad_norm": grad_norms[-1],
        "lr": lr,
        "reward_mean": float(rewards.mean()),  # the whole batch's, on every rank
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "tokens": tokens,
        "sequences": sequences,
        "passes": len(first),
        "iterations": len(iterations),
        "train_seconds": seconds,
    }


TOKEN_MEANS = ("kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction", "entropy", "is_ratio_mean",
               "is_truncated_fraction", "rs_rejected_tokens", "mismatch_kl")


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


def _pass(forward: Forward, segments: list[tuple[RolloutGroup, torch.Tensor, list[int]]], counts: tuple[int, int],
          oldest_version: int, held: HeldProof | None = None, frozen: Frozen | None = None) -> tuple[PassStats, Frozen]:
    """Forward and backward over some completions of some groups: (group, the rows' advantages,
    rows) each; the advantages are over each whole group, whichever of its completions this pass
    takes. `counts`: the whole batch's trained tokens and completions (the loss's aggregation).
    `frozen`: what the batch's first iteration fixed (none: this is the first)."""
    cfg, device, acfg = forward.cfg, forward.device, forward.cfg.algorithm
    prompts = [group.prompt_token_ids for group, _, _ in segments]
    claimed = [group.completions[i] for group, _, rows in segments for i in rows]
    owners = [j for j, (_, _, rows) in enumerate(segments) for _ in rows]
    advantages = torch.cat([rows_advantages for _, rows_advantages, _ in segments])
    pass_groups = [(group, rows) for group, _, rows in segments]
    # The held version's token margins, from the logits the log-probs are made of.
    margins = None if held is None else held.observer(pass_groups, claimed, cfg.sampling.temperature, device)
    replay = RoutingReplay.of(pass_groups) if acfg.router_replay == "replay" else None  # each token's recorded experts
    logprobs, mask, entropy, ref_logprobs = forward(prompts, [c.token_ids for c in claimed], owners, margins,
                                                    reference=frozen is None, replay=replay)
    checked = {} if held is None else held.checks(pass_groups, logprobs.detach(), margins, replay)
    if frozen is None:
        frozen = _freeze(logprobs.detach(), mask, ref_logprobs, segments, claimed, oldest_version, acfg, device)
    mask = frozen.mask
    scales = row_scales(mask.sum(-1), acfg.loss_aggregation, *counts, cfg.sampling.max_new_tokens)
    objective = Objective(acfg.clip_low, acfg.clip_high, acfg.ratio_level, acfg.kl_coef, acfg.kl_estimator)
    loss, loss_stats = policy_loss(logprobs, frozen.old_logprobs, advantages, mask, objective, scales.to(device),
                                   frozen.weights, frozen.ref_logprobs)
    loss.backward()
    stats = PassStats(int(mask.sum()), len(claimed), loss.item(), loss_stats, frozen.importance,
                      float(entropy[mask].mean()) if mask.any() else 0.0, checked)
    return stats, frozen


def _freeze(old_logprobs: torch.Tensor, mask: torch.Tensor, ref_logprobs, segments, claimed, oldest_version: int,
            acfg, device) -> Frozen:
    """From a pass's first forward: the tokens it trains (the model's own, within the staleness
    bound, of completions not masked as truncated), and the rollout correction pi_old / mu."""
    behaviour, sampled = torch.zeros(mask.shape), torch.zeros(mask.shape, dtype=torch.bool)
    for i, completion in enumerate(claimed):
        behaviour[i, : len(completion.logprobs)] = torch.tensor(completion.logprobs)
        if not (acfg.mask_truncated and completion.truncated):
            sampled[i, : len(completion.token_ids)] = torch.from_numpy(completion.model_mask())
    mask = mask & sampled.to(mask.device)  # an episode's observations are the environment's: never trained
    stale = [group.sampled_from(oldest_version) for group, _, rows in segments for _ in rows]
    if any(stale):
        mask = mask & (torch.arange(mask.shape[1], device=mask.device) >= torch.tensor(stale, device=mask.device)[:, None])
    correction = Correction(acfg.rollout_is, acfg.rollout_is_threshold, acfg.rollout_rs,
                            acfg.rollout_rs_threshold_lower, acfg.rollout_rs_threshold, acfg.rollout_rs_k3_threshold)
    weights, importance = rollout_correction(old_logprobs, behaviour.to(device), mask, correction)
    return Frozen(old_logprobs, mask, weights, importance, ref_logprobs)


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
