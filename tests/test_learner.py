"""The learner's step: micro-batching a group's completions changes memory, not the step."""

import copy

import pytest
import torch

from echo.model.loading import load_model
from echo.model.policy import make_policy
from echo.train.learner import (
    Batch,
    Forward,
    Rewarded,
    learning_rate,
    make_optimizer,
    micro_batches,
    shares_passes,
    step_passes,
    train_step,
)
from tests.conftest import tiny_config
from tests.groups import honest_group


@pytest.mark.parametrize("budget, expected", [
    (0, [[(0, [0, 1, 2, 3])]]),  # off: the whole group in one forward
    (30, [[(0, [0, 1])], [(0, [2, 3])]]),  # 10 + 2 x 5 fits, 10 + 3 x 8 does not; 10 + 2 x 8 fits
    (12, [[(0, [0])], [(0, [1])], [(0, [2])], [(0, [3])]]),  # each alone is over budget: a forward of its own
    (1000, [[(0, [0, 1, 2, 3])]]),
])
def test_completions_are_packed_in_order_under_the_token_budget(budget, expected):
    assert micro_batches([(10, [5, 3, 8, 2])], budget) == expected


@pytest.mark.parametrize("budget, expected", [
    (0, [[(0, [0, 1])], [(1, [0, 1])], [(2, [0])]]),  # off: a group a pass
    # 2 prompts x 10 + 4 x 5 = 40 fits; with the third group 3 x 10 + 5 x 5 = 55 does not
    (40, [[(0, [0, 1]), (1, [0, 1])], [(2, [0])]]),
    (55, [[(0, [0, 1]), (1, [0, 1]), (2, [0])]]),
    # 2 x 10 + 3 x 5 = 35 fits; the next completion would make 2 x 10 + 4 x 5 = 40
    (35, [[(0, [0, 1]), (1, [0])], [(1, [1]), (2, [0])]]),
])
def test_several_groups_share_a_pass_under_the_token_budget(budget, expected):
    assert micro_batches([(10, [5, 3]), (8, [4, 5]), (10, [2])], budget) == expected


def test_groups_keep_passes_of_their_own_unless_sharing_is_on():
    groups = [(10, [5, 3]), (8, [4, 5]), (10, [2])]
    assert micro_batches(groups, 55, share=False) == [[(0, [0, 1])], [(1, [0, 1])], [(2, [0])]]
    # 10 + 2 x 5 and 8 + 2 x 5 are over 16: each group split, and still no pass of two groups
    assert micro_batches(groups, 16, share=False) == [[(0, [0])], [(0, [1])], [(1, [0])], [(1, [1])], [(2, [0])]]
    assert shares_passes("auto", torch.device("cpu")) is False and shares_passes("auto", torch.device("cuda")) is True
    assert shares_passes("on", torch.device("cpu")) is True and shares_passes("off", torch.device("cuda")) is False


@pytest.mark.parametrize("algorithm", [
    {"rollout_rs": "geometric"},  # token mean, the batch's token count in every pass
    # each completion's token mean over the batch's completions, two updates, IcePop's token mask
    {"preset": "grpo", "num_iterations": 2, "rollout_is": "off", "rollout_rs": "token", "kl_estimator": "k2"},
    {"preset": "dr_grpo", "scale_rewards": "batch"},  # a constant over the batch's completions
], ids=["default", "grpo-2-iterations", "dr_grpo"])
def test_a_micro_batched_step_is_the_whole_batch_step(tmp_path, algorithm):
    """Same start, same batch (with a KL term and a rollout rejection): the step in micro-batches
    of a few tokens, or with both groups in one pass, leaves the same adapter as a group a pass
    and reports the same statistics, to fp32 summation-order error (1e-6), whatever the loss's
    aggregation and however many updates it takes on the batch.

    The parameters are fp64 (the log-probs stay fp32): AdamW divides each gradient element by its
    own size, so an fp32 summation-order error in an element whose terms nearly cancel became a
    share of a learning-rate step (1.4e-6 apart at lr 1e-4, on about one random start in
    fifteen); gradients accumulated in fp64 left at most 3e-8 over 60 starts. The start is seeded: one that fails
    fails again."""
    texts = ["\\boxed{5}", "no idea at all, sorry", "\\boxed{999} because", "hm"]
    batch = Batch([Rewarded(honest_group(11 + i, texts=texts), [1.0, 0.0, 0.0, 1.0]) for i in range(2)])
    assert len({len(r.group.prompt_token_ids) for r in batch.groups}) == 2  # packed, one prompt is padded
    policies, stats = [], []
    base, tokenizer = load_model("tiny")
    start = make_policy(base, tiny_config(tmp_path).lora).double()
    seeded = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in start.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=seeded)
    for budget in (0, len(batch.groups[0].group.prompt_token_ids) + 30, 10_000):
        cfg = tiny_config(tmp_path, trainer={"micro_batch_tokens": budget, "pack_groups": "on"},
                          algorithm={"kl_coef": 0.1, **algorithm})
        policy = copy.deepcopy(start)
        stats.append(train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), make_optimizer(policy, cfg), batch))
        policies.append(policy)
    split = len(step_passes(batch, len(batch.groups[0].group.prompt_token_ids) + 30))
    assert [s["passes"] for s in stats] == [2, split, 1]
    assert stats[1]["passes"] > 2  # it did split the groups, and packed them in one pass
    whole, *others = ([p.detach() for p in policy.parameters() if p.requires_grad] for policy in policies)
    for other, other_stats in zip(others, stats[1:]):
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(whole, other))
        for key in ("loss", "kl", "entropy", "is_ratio_mean", "is_masked_fraction", "grad_norm", "tokens"):
            assert other_stats[key] == pytest.approx(stats[0][key], abs=1e-6), key


def test_a_partial_rollouts_tokens_older_than_the_bound_are_not_trained(tmp_path):
    """A group versions 2, 3 and 4 sampled in turn, trained at a bound that accepts 3 and newer:
    its first 2 tokens of each completion are left out of the loss (whatever their log-probs
    say), the rest are trained, and the step counts only those."""
    texts = ["\\boxed{5} and so on", "no idea at all, sorry"]
    spanning = honest_group(11, texts=texts, version=2,
                            version_changes=[{"at": 2, "version": 3}, {"at": 4, "version": 4}])
    base, tokenizer = load_model("tiny")
    start = make_policy(base, tiny_config(tmp_path).lora)
    cfg = tiny_config(tmp_path)
    steps = []
    for group in (spanning, spanning.replaced(completions=[  # other log-probs for the stale tokens only
            c.replaced(logprobs=[-3.0, -3.0, *c.logprobs[2:]]) for c in spanning.completions])):
        policy = copy.deepcopy(start)
        batch = Batch([Rewarded(group, [1.0, 0.0])], oldest_version=3)
        stats = train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), make_optimizer(policy, cfg), batch)
        steps.append(([p.detach() for p in policy.parameters() if p.requires_grad], stats))
    (first, stats), (second, _) = steps
    assert stats["tokens"] == sum(len(c.token_ids) - 2 for c in spanning.completions)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    policy = copy.deepcopy(start)
    batch = Batch([Rewarded(spanning, [1.0, 0.0])], oldest_version=2)
    whole = train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), make_optimizer(policy, cfg), batch)
    assert whole["tokens"] == sum(len(c.token_ids) for c in spanning.completions)


def test_an_episodes_observations_are_not_trained(tmp_path):
    """A multi-turn episode: the model's turns around the environment's observation. Its
    observation tokens are left out of the loss and of the importance weights (other log-probs
    claimed for them change nothing), the step counts the model's tokens only; the same tokens
    all taken as the model's train otherwise."""
    texts = ["\\boxed{5} and so on, then more", "no idea at all, sorry"]
    plain = honest_group(11, texts=texts)
    first = plain.completions[0]
    observation = {"at": 4, "tokens": 6}
    episode = plain.replaced(completions=[
        first.replaced(observations=[observation], logprobs=[*first.logprobs[:4], *[0.0] * 6, *first.logprobs[10:]]),
        plain.completions[1]])
    other_claims = episode.replaced(completions=[
        episode.completions[0].replaced(logprobs=[*first.logprobs[:4], *[-7.0] * 6, *first.logprobs[10:]]),
        plain.completions[1]])
    base, tokenizer = load_model("tiny")
    start = make_policy(base, tiny_config(tmp_path).lora)
    cfg = tiny_config(tmp_path, algorithm={"kl_coef": 0.1})
    results = []
    for group in (episode, other_claims, plain):
        policy = copy.deepcopy(start)
        stats = train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), make_optimizer(policy, cfg),
                           Batch([Rewarded(group, [1.0, 0.0])]))
        results.append(([p.detach() for p in policy.parameters() if p.requires_grad], stats))
    (trained, stats), (claimed_otherwise, _), (unmasked, plain_stats) = results
    assert stats["tokens"] == sum(len(c.token_ids) for c in plain.completions) - 6 == plain_stats["tokens"] - 6
    assert all(torch.equal(a, b) for a, b in zip(trained, claimed_otherwise))
    assert not all(torch.allclose(a, b) for a, b in zip(trained, unmasked))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3, 12])
def test_the_learning_rate_schedules_are_transformers_own(tmp_path, schedule, warmup):
    """Step by step the rate transformers' scheduler gives the optimizer (a TRL or verl user's
    schedules), the warmup longer than the run too; a function of the step alone, so a resumed
    run (test_resume's kill -9) goes on at the same rate."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    steps = 10
    cfg = tiny_config(tmp_path, run={"steps": steps}, trainer={"lr": 3e-4, "lr_schedule": schedule, "warmup_steps": warmup})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    reference = {"constant": lambda: get_constant_schedule_with_warmup(optimizer, warmup),
                 "linear": lambda: get_linear_schedule_with_warmup(optimizer, warmup, steps),
                 "cosine": lambda: get_cosine_schedule_with_warmup(optimizer, warmup, steps)}[schedule]()
    theirs = []
    for _ in range(steps):
        theirs.append(optimizer.param_groups[0]["lr"])  # what this optimizer step runs with
        optimizer.step()
        reference.step()
    assert [learning_rate(cfg, step) for step in range(1, steps + 1)] == pytest.approx(theirs, abs=1e-12)


def test_a_step_runs_at_its_scheduled_rate_and_reports_it(tmp_path):
    cfg = tiny_config(tmp_path, trainer={"lr_schedule": "linear", "warmup_steps": 2})
    base, tokenizer = load_model("tiny")
    model = make_policy(base, cfg.lora)
    optimizer = make_optimizer(model, cfg)
    batch = Batch([Rewarded(honest_group(), [1.0, 0.0])], step=2)
    stats = train_step(Forward.of(model, cfg, tokenizer.pad_token_id), optimizer, batch)
    assert stats["lr"] == optimizer.param_groups[0]["lr"] == cfg.trainer.lr / 2


def _trained(tmp_path, batch: Batch, **algorithm) -> tuple[list[torch.Tensor], dict]:
    base, tokenizer = load_model("tiny")
    torch.manual_seed(0)
    policy = make_policy(base, tiny_config(tmp_path).lora)
    cfg = tiny_config(tmp_path, algorithm=algorithm, trainer={"lr": 1e-2})
    stats = train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), make_optimizer(policy, cfg), batch)
    return [p.detach() for p in policy.parameters() if p.requires_grad], stats


def test_a_truncated_completion_is_left_out_of_the_loss_where_masked(tmp_path):
    """algorithm.mask_truncated (TRL's mask_truncated_completions): a completion the length limit
    stopped (no end-of-sequence token; the scorer holds finish_reason to that) trains nothing,
    whatever its tokens; its tokens leave the token mean's denominator."""
    texts = ["\\boxed{5}", "no idea", "\\boxed{999} because", "hm"]
    group = honest_group(11, texts=texts)
    cut = [c.replaced(token_ids=c.token_ids[:-1], logprobs=c.logprobs[:-1], finish_reason="length") for c in
           group.completions[2:]]
    truncated = group.model_copy(update={"completions": [*group.completions[:2], *cut]})
    other = group.model_copy(update={"completions": [*group.completions[:2], *(
        c.replaced(token_ids=c.token_ids[::-1]) for c in cut)]})  # other tokens where they are cut
    rewards = [1.0, 0.0, 0.0, 1.0]
    (masked, stats), (masked_other, _) = (_trained(tmp_path, Batch([Rewarded(g, rewards)]), mask_truncated=True)
                                          for g in (truncated, other))
    kept, kept_stats = _trained(tmp_path, Batch([Rewarded(truncated, rewards)]))
    assert stats["tokens"] == sum(len(c.token_ids) for c in group.completions[:2])
    assert kept_stats["tokens"] == stats["tokens"] + sum(len(c.token_ids) for c in cut)
    assert all(torch.equal(a, b) for a, b in zip(masked, masked_other))
    assert not all(torch.equal(a, b) for a, b in zip(masked, kept))


def test_several_updates_on_a_batch_move_the_ratio_and_the_clip_acts(tmp_path):
    """algorithm.num_iterations: one update leaves the ratio pi / pi_old at 1 (no clip); four on
    the same batch, with pi_old frozen at the first, move it past the clip. The rollout correction
    is the first iteration's: its statistics are the same either way."""
    texts = ["\\boxed{5}", "no idea at all, sorry", "\\boxed{999} because", "hm"]
    batch = Batch([Rewarded(honest_group(11 + i, texts=texts), [1.0, 0.0, 0.0, 1.0]) for i in range(2)])
    one, once = _trained(tmp_path, batch)
    four, four_times = _trained(tmp_path, batch, num_iterations=4, clip_low=0.01, clip_high=0.01)
    assert once["iterations"] == 1 and once["clip_fraction"] == 0.0
    assert four_times["iterations"] == 4 and four_times["clip_fraction"] > 0
    assert four_times["clip_low_fraction"] + four_times["clip_high_fraction"] == pytest.approx(four_times["clip_fraction"])
    for key in ("is_ratio_mean", "is_ratio_max", "mismatch_kl", "tokens", "entropy"):
        assert four_times[key] == pytest.approx(once[key]), key
    assert not all(torch.equal(a, b) for a, b in zip(one, four))
