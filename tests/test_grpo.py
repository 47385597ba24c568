import math

import pytest
import torch

from echo.train.algorithms.corrections import Correction, rollout_correction
from echo.train.algorithms.grpo import Objective, advantages, policy_loss, token_logprobs


def grpo_loss(logprobs, old, adv, mask, clip_eps, normalizer, weights=None, ref_logprobs=None, kl_coef=0.0):
    """The default objective (a symmetric clip, a token mean over `normalizer` tokens)."""
    scales = torch.full((logprobs.shape[0],), 1.0 / normalizer)
    return policy_loss(logprobs, old, adv, mask, Objective(clip_eps, clip_eps, kl_coef=kl_coef), scales, weights,
                       ref_logprobs)


def importance_weights(old, behaviour, mask, cap, level):
    """The rollout correction as the trainer's is_level named it before algorithm.rollout_is/rs."""
    correction = (Correction("token", cap, "geometric", 1 / cap, cap) if level == "sequence"
                  else Correction(level, cap))
    return rollout_correction(old, behaviour, mask, correction)


@pytest.mark.parametrize("value", [0.5, 0.1, 0.3, 1 / 3, 0.7, 0.9])
@pytest.mark.parametrize("size", [4, 8, 16, 64])
def test_equal_rewards_give_exactly_zero_advantage(value, size):
    """8 float32 rewards of 0.1 (the format reward, SmolLM2's commonest early outcome) gave
    -0.0074 each: the mean's rounding divided by a std of ~1e-8. Group size 4 happened to give 0."""
    for scale in ("group", "batch", "none"):
        assert torch.equal(advantages([[value] * size, [0.0, 1.0]], scale)[0], torch.zeros(size))


def test_advantages_by_hand():
    # mean 0.25, unbiased std of [1,0,0,0] = sqrt(0.25) = 0.5
    [adv] = advantages([[1.0, 0.0, 0.0, 0.0]], eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_token_logprobs_follow_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert token_logprobs(logits, tokens, 1.0).item() == pytest.approx(-math.log1p(math.exp(-2.0)))
    assert token_logprobs(logits, tokens, 2.0).item() == pytest.approx(-math.log1p(math.exp(-1.0)))


def _loss(ratio: float, advantage: float, clip_eps: float = 0.2):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    behaviour = torch.zeros(1, 1)
    loss, stats = grpo_loss(logprobs, behaviour, torch.tensor([advantage]), torch.ones(1, 1, dtype=torch.bool),
                            clip_eps=clip_eps, normalizer=1.0)
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


def test_on_policy_loss_is_minus_advantage_and_unclipped():
    loss, grad, stats = _loss(1.0, 2.0)
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx(-2.0)  # d(-r*A)/dlogp = -r*A
    assert stats.clip_fraction == 0.0


def test_clip_above_for_positive_advantage():
    loss, grad, stats = _loss(1.5, 1.0)  # ratio past 1 + eps: clipped, no gradient
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert stats.clip_fraction == 1.0


def test_clip_below_for_negative_advantage():
    loss, grad, _ = _loss(0.5, -1.0)  # ratio under 1 - eps with A < 0: clipped at 0.8
    assert loss == pytest.approx(0.8)
    assert grad == 0.0


def test_no_clip_on_the_pessimistic_side():
    # ratio 0.5 with A > 0: min(0.5*A, 0.8*A) = 0.5*A, still has gradient
    loss, grad, _ = _loss(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)


def test_mask_and_normalizer_give_a_token_mean():
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, stats = grpo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.2, normalizer=3.0)
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3)


def test_kl_term_is_zero_at_the_reference_and_positive_away():
    logprobs = torch.log(torch.tensor([[0.5]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, at_ref = grpo_loss(logprobs, logprobs, torch.tensor([0.0]), mask, 0.2, 1.0, ref_logprobs=logprobs, kl_coef=0.1)
    _, away = grpo_loss(logprobs, logprobs, torch.tensor([0.0]), mask, 0.2, 1.0,
                        ref_logprobs=torch.log(torch.tensor([[0.25]])), kl_coef=0.1)
    assert at_ref.kl == pytest.approx(0.0)
    assert away.kl == pytest.approx(0.5 - math.log(0.5) - 1)  # k3 with ref/policy = 0.5


def test_importance_weights_are_one_on_policy():
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    mask = torch.tensor([[True, True], [True, False]])
    weights, stats = importance_weights(logprobs, logprobs, mask, cap=2.0, level="token")
    assert torch.equal(weights, mask.float())
    assert stats.ratio_mean == 1.0 and stats.ratio_max == 1.0 and stats.truncated_fraction == 0.0
    assert stats.mismatch_kl == 0.0  # the trainer's log-probs are the sampler's


def test_token_level_truncates_at_the_cap():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))  # ratios 3, 1, 0.5
    weights, stats = importance_weights(old, behaviour, torch.ones(1, 3, dtype=torch.bool), cap=2.0, level="token")
    assert torch.allclose(weights, torch.tensor([[2.0, 1.0, 0.5]]))
    assert stats.ratio_max == pytest.approx(3.0) and stats.truncated_fraction == pytest.approx(1 / 3)
    assert stats.ratio_mean == pytest.approx(1.5)
    # KL(mu || pi_old) by k3, r - 1 - log r per token: (3 - 1 - ln 3) + 0 + (0.5 - 1 - ln 0.5), over 3
    assert stats.mismatch_kl == pytest.approx((2 - math.log(3) + math.log(2) - 0.5) / 3)


def test_off_weighs_every_sampled_token_one_and_still_measures_the_ratios():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))  # ratios 3, 1, 0.5
    mask = torch.tensor([[True, True, False]])
    weights, stats = importance_weights(old, behaviour, mask, cap=2.0, level="off")
    assert torch.equal(weights, mask.float())
    assert stats.ratio_max == pytest.approx(3.0) and stats.truncated_fraction == 0.0  # nothing was cut


def test_sequence_level_masks_sequences_too_far_off_policy():
    old = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.1], [0.4, 0.6]]))  # sequence 0: ratio 9 throughout
    mask = torch.ones(2, 2, dtype=torch.bool)
    weights, stats = importance_weights(old, behaviour, mask, cap=2.0, level="sequence")
    assert torch.equal(weights[0], torch.zeros(2))
    assert torch.allclose(weights[1], torch.tensor([1.25, 5 / 6]))
    assert stats.masked_fraction == 0.5


def test_weights_scale_the_policy_term():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, 0.2, 2.0, torch.tensor([[2.0, 0.5]]))
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -0.25]]))
