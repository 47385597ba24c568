"""Our objectives against TRL's own GRPOTrainer._compute_loss (trl pinned in the dev extra), on
the same log-probs, old log-probs, advantages, masks and importance ratios: the loss and its
gradient agree within 1e-6. Where TRL has no counterpart (geometric and k3 rejection, k1/k2 KL),
against the formula by hand. TRL's loss is called unbound, on an object holding only the
attributes it reads: the trainer around it (a model, a dataset, accelerate) is not needed."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from echo.config import PRESETS
from echo.train.algorithms.corrections import Correction, rollout_correction
from echo.train.algorithms.grpo import Objective, advantages, kl_estimate, policy_loss, row_scales

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

B, T, MAX_TOKENS = 6, 9, 12  # completions, their longest, sampling.max_new_tokens
AGGREGATION = {"grpo": "sequence_mean", "bnpo": "token_mean", "dr_grpo": "constant", "dapo": "token_mean"}


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 1, 9, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    behaviour = old + torch.randn(B, T, generator=g) * 0.3  # the sampler's mu, off the trainer's pi_old
    ref = old + torch.randn(B, T, generator=g) * 0.2
    step = torch.randn(B, T, generator=g) * 0.15  # one update's move of the log-probs
    adv = torch.randn(B, generator=g)
    return SimpleNamespace(mask=mask, old=old, behaviour=behaviour, ref=ref, step=step, adv=adv)


def trl_loss(loss_type, logprobs, b, *, eps_low=0.2, eps_high=0.2, level="token", beta=0.0, is_ratio=None):
    """TRL's _compute_loss on these tensors: one process, no gradient accumulation, one
    generation batch (its dapo normaliser is then the batch's tokens)."""
    this = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_TOKENS, _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                    gather_for_metrics=lambda x: x),
    )
    mask = b.mask.int()
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": b.adv, "old_per_token_logps": b.old, "num_items_in_batch": mask.sum(),
              "ref_per_token_logps": b.ref}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return trl_grpo.GRPOTrainer._compute_loss(this, None, inputs)


def ours(aggregation, logprobs, b, *, eps_low=0.2, eps_high=0.2, level="token", beta=0.0, weights=None):
    scales = row_scales(b.mask.sum(-1), aggregation, int(b.mask.sum()), B, MAX_TOKENS)
    loss, _ = policy_loss(logprobs, b.old, b.adv, b.mask, Objective(eps_low, eps_high, level, beta), scales, weights,
                          b.ref)
    return loss


def loss_and_grad(compute, b, iteration: int):
    """The loss and d loss / d log-probs at the batch's `iteration`-th update (0: pi = pi_old)."""
    logprobs = (b.old + iteration * b.step).requires_grad_()
    loss = compute(logprobs)
    loss.backward()
    return loss.detach(), logprobs.grad


def assert_same(theirs, mine, b):
    for iteration in range(4):  # several updates on one batch (TRL's num_iterations): the ratio moves off 1
        (t_loss, t_grad), (o_loss, o_grad) = (loss_and_grad(f, b, iteration) for f in (theirs, mine))
        assert o_loss.item() == pytest.approx(t_loss.item(), abs=1e-6), iteration
        assert torch.allclose(o_grad, t_grad, atol=1e-6, rtol=0), iteration


@pytest.mark.parametrize("loss_type", list(AGGREGATION))
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)], ids=["symmetric", "clip-higher"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
def test_each_loss_type_and_clip_is_trls(loss_type, clip, beta):
    b = batch(1)
    assert_same(lambda lp: trl_loss(loss_type, lp, b, eps_low=clip[0], eps_high=clip[1], beta=beta),
                lambda lp: ours(AGGREGATION[loss_type], lp, b, eps_low=clip[0], eps_high=clip[1], beta=beta), b)


def test_the_sequence_level_ratio_is_gspos_as_trl_computes_it():
    b = batch(2)
    low, high = PRESETS["gspo"]["clip_low"], PRESETS["gspo"]["clip_high"]
    assert_same(lambda lp: trl_loss("grpo", lp, b, eps_low=low, eps_high=high, level="sequence"),
                lambda lp: ours("sequence_mean", lp, b, eps_low=low, eps_high=high, level="sequence"), b)
    b.step *= 0.001  # within GSPO's clip of 3e-4 / 4e-4: the gradient flows, the clip does not act
    assert_same(lambda lp: trl_loss("grpo", lp, b, eps_low=low, eps_high=high, level="sequence"),
                lambda lp: ours("sequence_mean", lp, b, eps_low=low, eps_high=high, level="sequence"), b)


def trl_is_ratio(b, mode: str, clip_max: float, clip_min: float | None = None) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), by its formula."""
    diff = (b.old - b.behaviour) * b.mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    return ratio.masked_fill((ratio < low) | (ratio > clip_max), 0.0)


@pytest.mark.parametrize("mode, correction", [
    ("token_truncate", Correction("token", 2.0)),  # token TIS
    ("sequence_truncate", Correction("sequence", 2.0)),  # sequence TIS
    ("sequence_mask", Correction("sequence", math.inf, "sequence", 0.0, 2.0)),  # MIS (verl's seq_mis)
    ("token_mask", Correction("token", math.inf, "token", 0.5, 2.0)),  # IcePop: the ratio, masked outside the band
])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_rollout_corrections_weigh_the_loss_as_trls_importance_sampling(mode, correction, loss_type):
    b = batch(3)
    b.behaviour[1] = b.old[1] - 0.2  # a sequence ratio of e^0.8 = 2.2: past the cap
    b.behaviour[2, :3] = b.old[2, :3] + 1.0  # tokens at e^-1 = 0.37: below IcePop's band
    b.behaviour[0, 0] = b.old[0, 0] - 1.1  # a token at e^1.1 = 3: past the cap
    clip_min = 0.5 if mode == "token_mask" else None
    expected = trl_is_ratio(b, mode, 2.0, clip_min)
    weights, stats = rollout_correction(b.old, b.behaviour, b.mask, correction)
    assert torch.allclose(weights, (expected * b.mask).expand(B, T), atol=1e-6, rtol=0)
    assert (weights == 0).any() if "mask" in mode else stats.truncated_fraction > 0  # the cases act
    assert_same(lambda lp: trl_loss(loss_type, lp, b, is_ratio=expected),
                lambda lp: ours(AGGREGATION[loss_type], lp, b, weights=weights), b)


def test_geometric_and_k3_rejection_leave_out_whole_completions_by_hand():
    b = batch(4)
    log_ratio = (b.old - b.behaviour) * b.mask
    n = b.mask.sum(-1)
    geometric = torch.exp(log_ratio.sum(-1) / n)
    _, tis = rollout_correction(b.old, b.behaviour, b.mask, Correction("token", 2.0))
    weights, stats = rollout_correction(b.old, b.behaviour, b.mask, Correction("token", 2.0, "geometric", 0.9, 1.1))
    kept = (geometric >= 0.9) & (geometric <= 1.1)
    assert 0 < kept.sum() < B  # some in, some out
    assert torch.equal(weights.sum(-1) > 0, kept)
    assert stats.masked_fraction == pytest.approx(1 - kept.float().mean().item())
    k3 = ((torch.exp(log_ratio) - 1 - log_ratio) * b.mask).sum(-1) / n  # KL(mu || pi_old) by k3, per completion
    weights, stats = rollout_correction(b.old, b.behaviour, b.mask, Correction("off", 2.0, "k3", k3_max=0.04))
    assert torch.equal(weights.sum(-1) > 0, k3 <= 0.04) and 0 < int((k3 <= 0.04).sum()) < B
    assert stats.mismatch_kl == pytest.approx(tis.mismatch_kl)  # measured alike whatever the correction


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref  # log(p/q)
    assert torch.allclose(kl_estimate(lp, ref, "k1"), d)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), d**2 / 2)
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.exp(-d) + d - 1)  # TRL's: exp(ref - lp) - (ref - lp) - 1


def test_advantage_scaling_is_trls():
    """TRL's sum_then_normalize advantages (rewards less the group mean, over the group's or the
    batch's std plus 1e-4, or unscaled), on groups of 4; a group of equal rewards gets 0."""
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.1], [0.3, 0.3, 0.3, 0.3]]
    r = torch.tensor(rewards, dtype=torch.float64)
    centred = r - r.mean(1, keepdim=True)
    expected = {"group": centred / (r.std(1, keepdim=True) + 1e-4), "batch": centred / (r.std() + 1e-4),
                "none": centred}
    for scale, theirs in expected.items():
        mine = torch.stack(advantages(rewards, scale))
        assert torch.allclose(mine[:2], theirs[:2].float(), atol=1e-6), scale
        assert torch.equal(mine[2], torch.zeros(4))
