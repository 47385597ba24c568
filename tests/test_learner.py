"""The learner's step: micro-batching a group's completions changes memory, not the step."""

import copy

import pytest
import torch

from echo.learner import make_optimizer, micro_batches, train_step
from echo.models import load_model
from echo.policy import make_policy
from tests.conftest import tiny_config
from tests.test_referee import honest_group


@pytest.mark.parametrize("budget, expected", [
    (0, [[0, 1, 2, 3]]),  # off: the whole group in one forward
    (30, [[0, 1], [2, 3]]),  # 10 + 2 x 5 fits, 10 + 3 x 8 does not; 10 + 2 x 8 fits
    (12, [[0], [1], [2], [3]]),  # each alone is over budget: a forward of its own
    (1000, [[0, 1, 2, 3]]),
])
def test_completions_are_packed_in_order_under_the_token_budget(budget, expected):
    assert micro_batches(10, [5, 3, 8, 2], budget) == expected


def test_a_micro_batched_step_is_the_whole_batch_step(tmp_path):
    """Same start, same batch (with a KL term and sequence-level importance masks): the step in
    micro-batches of a few tokens leaves the same adapter and reports the same statistics, to
    fp32 summation-order error (1e-6)."""
    texts = ["\\boxed{5}", "no idea at all, sorry", "\\boxed{999} because", "hm"]
    batch = [(honest_group(12 + i, texts=texts), [1.0, 0.0, 0.0, 1.0]) for i in range(2)]
    policies, stats = [], []
    base, tokenizer = load_model("tiny")
    start = make_policy(base, tiny_config(tmp_path).lora)
    with torch.no_grad():
        for p in start.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    for budget in (0, len(batch[0][0].prompt_token_ids) + 30):
        cfg = tiny_config(tmp_path, trainer={"micro_batch_tokens": budget, "kl_coef": 0.1, "is_level": "sequence"})
        policy = copy.deepcopy(start)
        stats.append(train_step(policy, make_optimizer(policy, cfg), batch, cfg, tokenizer.pad_token_id))
        policies.append(policy)
    assert len(micro_batches(len(batch[0][0].prompt_token_ids), [len(c.token_ids) for c in batch[0][0].completions],
                             len(batch[0][0].prompt_token_ids) + 30)) > 1  # it did split the groups
    whole, micro = ([p.detach() for p in policy.parameters() if p.requires_grad] for policy in policies)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(whole, micro))
    for key in ("loss", "kl", "entropy", "is_ratio_mean", "is_masked_fraction", "grad_norm", "tokens"):
        assert stats[1][key] == pytest.approx(stats[0][key], abs=1e-6), key
