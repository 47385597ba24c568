"""The parity bench's verdict (bench/parity.py): an exact permutation test over seeds, so that
bimodal scores (a seed takes off or does not) are judged without assuming normal noise. And a
run's summary from its metrics."""

import math

import pytest

from bench.parity import permutation_p, run_summary, verdict
from tests.conftest import tiny_config
from workers.accounting import metrics_line


def modes(scores: dict[str, list[float]]) -> dict:
    return {name: {"held_out_correct": {"values": values}, "seconds_per_step": {"mean": 1.0}}
            for name, values in scores.items()}


def test_three_seeds_apart_are_as_far_apart_as_three_seeds_can_be():
    # Of the 20 ways to deal six scores into two threes, two are this split (either way round).
    assert permutation_p([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]) == 2 / 20
    assert permutation_p([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]) == 1.0


def test_the_exact_test_counts_every_deal_of_the_pooled_scores():
    a, b = [1.0, 1.0, 0.14, 0.22, 1.0, 0.18], [0.08, 0.09, 0.07]
    # Only the observed deal and its mirror (the three 1.0s apart) are as extreme: 2 of C(9, 3).
    assert math.isclose(permutation_p(a, b), 2 / math.comb(9, 3))


def test_many_seeds_are_judged_on_random_deals_close_to_the_exact_value():
    a, b = [0.0] * 12 + [1.0] * 8, [0.0] * 16 + [1.0] * 4
    # Too many deals to count (C(40, 20) = 1.4e11); for 0/1 scores the exact p is hypergeometric:
    # the twelve 1s dealt into b's twenty places, as lopsided as the observed four or more so.
    def dealt(ones_in_b: int) -> float:
        return math.comb(12, ones_in_b) * math.comb(28, 20 - ones_in_b) / math.comb(40, 20)
    exact = sum(dealt(k) for k in range(13) if abs(2 * k - 12) >= 4)
    assert 0.1 < exact < 0.4
    assert abs(permutation_p(a, b, resamples=20_000) - exact) < 0.02


def test_a_bimodal_outcome_with_no_spread_in_one_mode_is_still_judged():
    # Three seeds that failed alike have no spread; the test asks how often a deal of the six
    # pooled scores is as lopsided, which here is every deal (the one take-off lands somewhere).
    v = verdict(modes({"sequential": [1.0, 0.05, 0.06], "async S=2": [0.08, 0.09, 0.07]}), "sequential", "async S=2")
    assert v["within_noise"] is True and v["p_value"] > 0.5


def test_identical_scores_everywhere_give_no_signal():
    v = verdict(modes({"colocated": [0.0, 0.0, 0.0], "async S=1": [0.0, 0.0, 0.0]}), "colocated", "async S=1")
    assert v["within_noise"] is None and v["gap"] == 0


@pytest.mark.parametrize("mode, samplers, sampler_busy", [("async S=1", 4, 0.25), ("colocated", 4, 1.0)])
def test_sampler_busy_is_over_the_runs_own_samplers(tmp_path, mode, samplers, sampler_busy):
    """Generating time over the samplers' wall time: the run's sampler.count of them (the
    co-located run generates in its one process)."""
    cfg = tiny_config(tmp_path, sampler={"count": samplers})
    cfg.run_dir.mkdir(parents=True)
    lines = [{"step": step, "reward_mean": 0.5, "wall_seconds": 10.0 * step, "busy_seconds": 5.0, "tokens": 90,
              "generated_seconds": 10.0 * sampler_busy * samplers if mode != "colocated" else 10.0,
              "dropped_tokens": 10, "dropped_stale": 1} for step in (1, 2)]
    (cfg.run_dir / "metrics.jsonl").write_bytes(b"".join(metrics_line(line) for line in lines))
    summary = run_summary(cfg, mode)
    assert summary["sampler_busy"] == pytest.approx(sampler_busy)
    assert summary["learner_busy"] == 0.5 and summary["seconds_per_step"] == 10.0
    assert summary["wasted_token_fraction"] == 0.1 and summary["dropped_groups"] == 2
