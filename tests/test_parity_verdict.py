"""The parity bench's statistics (bench/parity.py): an exact permutation test over seeds, so that
bimodal scores (a seed takes off or does not) are judged without assuming normal noise; the
log-rank test of steps to a threshold; the area under a held-out curve; the interleaved schedule;
cost per point. And a run's summary from its metrics."""

import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.letters import Letters
from bench.parity import (
    MEASURES,
    MODES,
    area_under,
    commit_results,
    detectable_gap,
    logrank_p,
    mode_summary,
    off_policy,
    permutation_p,
    reached,
    run_cost,
    run_summary,
    schedule,
    verdict,
)
from echo.engines import make_engine
from echo.train.heldout import held_out_score
from tests.conftest import tiny_config
from workers.trainer.accounting import metrics_line


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


def test_the_log_rank_test_by_hand():
    # a: events at steps 1 and 2; b: both censored at 3. At t=1: 4 at risk (2 a), 1 event in a:
    # O-E = 1 - 2/4, V = 1/4. At t=2: 3 at risk (1 a), 1 event in a: O-E += 1 - 1/3, V += 2/9.
    # chi2 = (7/6)^2 / (17/36) = 49/17; p = erfc(sqrt(chi2 / 2)).
    a, b = [(1, True), (2, True)], [(3, False), (3, False)]
    assert logrank_p(a, b) == pytest.approx(math.erfc(math.sqrt(49 / 17 / 2)))  # ~0.0896
    assert logrank_p(a, b) == pytest.approx(logrank_p(b, a))
    assert logrank_p(a, a) == pytest.approx(1.0)
    assert logrank_p([(60, False)] * 3, [(60, False)] * 3) == 1.0  # nobody reached it: nothing to compare


def test_ten_seeds_a_mode_tell_early_from_late_learners():
    """The power the study is for: every seed of one mode reaching the threshold by step 20, of
    the other at step 40 or never, is a clear difference; half and half of each is none."""
    early = [(20, True)] * 8 + [(10, True)] * 2
    late = [(40, True)] * 5 + [(60, False)] * 5
    assert logrank_p(early, late) < 0.001
    mixed = [(20, True)] * 5 + [(60, False)] * 5
    assert logrank_p(mixed, list(reversed(mixed))) == pytest.approx(1.0)


def test_a_held_out_curve_gives_its_area_and_its_time_to_a_threshold():
    curve = [[0, 0.3, 0.4], [10, 0.5, 0.6], [20, 0.7, 0.8], [30, 0.7, 0.8]]
    assert area_under(curve) == pytest.approx((10 * 0.4 + 10 * 0.6 + 10 * 0.7) / 30)
    assert reached(curve, 0.6) == (20, True)
    assert reached(curve, 0.3) == (10, True)  # the base model's point is not a step of training
    assert reached(curve, 0.9) == (30, False)  # censored at the last step


def test_the_schedule_interleaves_modes_so_none_owns_a_stretch_of_time():
    modes, n = list(MODES), len(MODES)
    planned = schedule(modes, range(10))
    assert sorted(planned) == sorted((m, s) for m in modes for s in range(10))  # each run once
    for seed in range(10):  # a seed's runs together, then the next seed's
        assert {m for m, s in planned[n * seed: n * seed + n]} == set(modes)
    for mode in modes:  # over as many seeds as modes, a mode is in every position once
        assert sorted(planned[n * s: n * s + n].index((mode, s)) for s in range(n)) == list(range(n))


def run(final: float, seconds_per_step: float = 1.0, mode: str = "async S=1", reward: float | None = None,
        steps: list[dict] = ()) -> dict:
    return {"mode": mode, "curve": [[0, 0.3, 0.3], [10, final, final if reward is None else reward]],
            # the busy shares as recorded before 2026-12-07: summarize reads them in today's words
            "seconds_per_step": seconds_per_step, "learner_busy": 0.9, "sampler_busy": 0.5,
            "wasted_token_fraction": 0.0, "wall_seconds": 3600.0, "learner_seconds": 1800.0, "sampler_seconds": 3600.0,
            "steps": list(steps)}


def modes(finals: dict[str, list[float]]) -> dict:
    base = {"correct": 0.3}
    return {name: mode_summary(name, [run(f) for f in values], base, 0.6, {"trainer": 2.0, "sampler": 0.5})
            for name, values in finals.items()}


def test_a_bimodal_outcome_with_no_spread_in_one_mode_is_still_judged():
    # Three seeds that failed alike have no spread; the test asks how often a deal of the six
    # pooled scores is as lopsided, which here is every deal (the one take-off lands somewhere).
    v = verdict(modes({"sequential": [1.0, 0.05, 0.06], "async S=2": [0.08, 0.09, 0.07]}), "sequential", "async S=2",
                0.6)
    assert v["within_noise"] is True and v["p_values"]["final"] > 0.5 and v["reached"] == [1, 0]


def test_identical_scores_everywhere_give_no_signal():
    v = verdict(modes({"colocated": [0.0, 0.0, 0.0], "async S=1": [0.0, 0.0, 0.0]}), "colocated", "async S=1", 0.6)
    assert v["within_noise"] is None and v["final_gap"] == 0


def test_ten_seeds_that_all_learn_more_are_not_within_noise():
    v = verdict(modes({"sequential": [0.4] * 5 + [0.5] * 5, "async S=1": [0.8] * 5 + [0.9] * 5}), "sequential",
                "async S=1", 0.6)
    assert v["within_noise"] is False and v["p_values"]["final"] < 0.001 and v["reached"] == [0, 10]


def test_what_a_verdict_could_detect_shrinks_with_the_square_root_of_the_seeds():
    ten = [0.1, 0.3] * 5  # standard deviation 0.105
    # 2.80 standard errors of the gap: 1.96 for the test at 0.05, 0.84 for 4 times in 5.
    assert detectable_gap(ten, ten) == pytest.approx(2.8016 * 0.10541 * math.sqrt(2 / 10), rel=1e-3)
    assert detectable_gap(ten * 4, ten * 4) == pytest.approx(detectable_gap(ten, ten) / 2, rel=0.05)
    v = verdict(modes({"colocated": ten, "async S=1": [x + 0.01 for x in ten]}), "colocated", "async S=1", 0.6)
    assert v["within_noise"] is True and v["detectable"]["final"] == pytest.approx(0.132, abs=1e-3)
    one_seed = verdict(modes({"colocated": [0.1], "async S=1": [0.2]}), "colocated", "async S=1", 0.6)
    assert one_seed["detectable"] is None  # no spread to judge by


def test_a_study_judged_on_reward_reads_the_reward_of_each_point():
    # Nobody is ever fully correct; the rewards tell the modes apart.
    runs = {"colocated": [run(0.0, reward=r) for r in [0.8] * 2 + [0.85] * 2],
            "async S=8": [run(0.0, reward=r) for r in [0.5] * 2 + [0.55] * 2]}
    summaries = {name: mode_summary(name, rs, {"correct": 0.0, "reward": 0.1}, 0.7, {"trainer": 2.0, "sampler": 0.5},
                                    "reward") for name, rs in runs.items()}
    v = verdict(summaries, "colocated", "async S=8", 0.7, "reward")
    assert v["within_noise"] is False and v["final_gap"] == pytest.approx(-0.3) and v["reached"] == [4, 0]
    assert summaries["colocated"]["final"]["mean"] == pytest.approx(0.825)
    assert area_under(runs["colocated"][0]["curve"], MEASURES["reward"]) == pytest.approx((0.3 + 0.8) / 2)
    assert verdict(summaries, "colocated", "async S=8", 0.7)["within_noise"] is None  # correct: 0 everywhere


def test_how_far_off_policy_a_mode_trained_is_read_from_its_steps():
    steps = [{"staleness_used": {"8": 3, "7": 1}, "is_ratio_mean": 1.1, "is_ratio_max": 3.0, "mismatch_kl": 0.02},
             {"staleness_used": {"8": 4}, "is_ratio_mean": 0.9, "is_ratio_max": 5.0, "mismatch_kl": 0.04}]
    measured = off_policy([run(0.5, steps=steps), run(0.5, steps=steps[:1])])
    assert measured["staleness"]["values"] == [pytest.approx(63 / 8), pytest.approx(31 / 4)]
    assert measured["is_ratio_mean"]["values"] == [pytest.approx(1.0), pytest.approx(1.1)]
    assert measured["is_ratio_max"]["max"] == 5.0 and measured["mismatch_kl"]["mean"] == pytest.approx(0.025)
    assert "is_truncated_fraction" not in measured  # not measured: left out, not made 0


def test_the_controlled_task_gives_partial_credit_near_the_letter_and_full_marks_only_for_it():
    task = Letters({})
    prompt = task.prompt(0)
    letter = prompt.answer
    assert task.score(letter * 8, prompt).reward == 1.0 and task.score(letter * 8, prompt).correct
    near = chr(ord(letter) + 1) if letter != "z" else "y"
    assert 0.95 < task.score(near * 8, prompt).reward < 1.0 and not task.score(near * 8, prompt).correct
    assert task.score(letter * 4, prompt).reward == 0.5  # half the bytes written
    assert task.score("\x00" * 8, prompt).reward == 0.0  # far from every letter
    held_out = {p.messages[-1]["content"] for p in task.held_out(64)}
    assert len(held_out) == 64 and not held_out & {task.prompt(i).messages[-1]["content"] for i in range(2000)}
    assert len({p.answer for p in task.held_out(64)}) > 15  # held out by prompt, not by letter: trained letters


def test_a_held_out_score_by_sampling_draws_alike_for_every_version_scored(tmp_path):
    cfg = tiny_config(tmp_path, task={"name": "bench.letters:Letters"})
    engine, task = make_engine(cfg), Letters({})
    prompts = task.held_out(6)

    def score(samples: int, seed: int = 0) -> float:
        return held_out_score(engine, task, prompts, 8, batch=4, samples=samples, seed=seed)[0]

    assert score(4) == score(4) != score(4, seed=1)  # the same draws, whoever asks; other draws differ
    assert score(0) == score(0)  # greedy


def test_cost_is_busy_time_at_the_stated_prices_and_a_point_is_a_percent_gained():
    prices = {"trainer": 2.0, "sampler": 0.5}
    assert run_cost(run(0.5), "async S=1", prices) == pytest.approx(0.5 * 2.0 + 1.0 * 0.5)
    assert run_cost(run(0.5), "colocated", prices) == pytest.approx(1.0 * 2.0)  # one device, its whole time
    summary = mode_summary("async S=1", [run(0.5), run(0.7)], {"correct": 0.3}, 0.6, prices)
    assert summary["usd_per_point"] == pytest.approx(1.5 / 30)  # 0.3 -> 0.6 mean: 30 points for $1.50
    assert mode_summary("async S=1", [run(0.2)], {"correct": 0.3}, 0.6, prices)["usd_per_point"] is None


@pytest.mark.parametrize("mode, samplers, sampler_utilisation", [("async S=1", 4, 0.25), ("colocated", 4, 1.0)])
def test_a_runs_summary_keeps_its_pace_and_every_steps_metrics(tmp_path, mode, samplers, sampler_utilisation):
    """Sampler busy is generating time over the samplers' wall time: the run's sampler.count of
    them (the co-located run generates in its one process)."""
    cfg = tiny_config(tmp_path, sampler={"count": samplers})
    cfg.run_dir.mkdir(parents=True)
    lines = [{"step": step, "reward_mean": 0.5, "wall_seconds": 10.0 * step, "busy_seconds": 5.0, "tokens": 90,
              "generated_seconds": 10.0 * sampler_utilisation * samplers if mode != "colocated" else 10.0,
              "dropped_tokens": 10, "dropped_stale": 1, "is_ratio_mean": 1.0, "clip_fraction": 0.01, "kl": 0.002,
              "grad_norm": 0.3, "staleness_used": {"0": 3, "1": 1}, "rejected": {"prompt_mismatch": step},
              "proof_of_sampling": {"passed": step}} for step in (1, 2)]
    (cfg.run_dir / "metrics.jsonl").write_bytes(b"".join(metrics_line(line) for line in lines))
    summary = run_summary(cfg, mode)
    assert summary["sampler_utilisation"] == pytest.approx(sampler_utilisation)
    assert summary["utilisation"] == 0.5 and summary["seconds_per_step"] == 10.0
    assert summary["wasted_token_fraction"] == 0.1 and summary["dropped_groups"] == 2
    assert summary["rejected"] == {"prompt_mismatch": 3} and summary["proof_of_sampling"] == {"passed": 2}
    assert [s["grad_norm"] for s in summary["steps"]] == [0.3, 0.3]
    assert summary["steps"][0]["staleness_used"] == {"0": 3, "1": 1} and summary["steps"][1]["kl"] == 0.002


def test_each_run_is_committed_alone_whatever_else_the_work_tree_holds(tmp_path, monkeypatch):
    for who in ("AUTHOR", "COMMITTER"):  # a box with no git identity of its own
        monkeypatch.setenv(f"GIT_{who}_NAME", "bench")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "bench@localhost")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "start")
    (tmp_path / "other.py").write_text("work in progress")
    git("add", "other.py")  # staged, and not the study's to commit
    results = tmp_path / "parity-x.json"
    for run_number in (1, 2):
        results.write_text(str(run_number))
        commit_results(results, f"x: colocated seed {run_number}")
    assert git("log", "--format=%s").split("\n")[:2] == ["bench.parity x: colocated seed 2",
                                                          "bench.parity x: colocated seed 1"]
    assert git("show", "--name-only", "--format=", "HEAD~1").split() == ["parity-x.json"]
    assert git("diff", "--cached", "--name-only").split() == ["other.py"]


@pytest.mark.slow
def test_the_study_runs_interleaved_scores_curves_and_keeps_every_run(tmp_path):
    """The harness end to end on the tiny model (the quick preset, one seed of two modes, the
    second resumed): each run's held-out curve, metrics, commit and cost in the results, its
    weights deleted after."""
    def study(modes: str, *more: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "bench.parity", "--preset", "quick", "--seeds", "1", "--modes",
                               modes, "--out", str(tmp_path), "--work-dir", str(tmp_path / "work"), *more],
                              cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return orjson.loads((tmp_path / "parity-quick.json").read_bytes())

    study("colocated")  # a study stopped after its first run...
    results = study("colocated,async S=1", "--resume")  # ...goes on with the runs it has not made
    assert [r["mode"] for r in results["runs"]] == ["colocated", "async S=1"]
    for r in results["runs"]:
        assert [point[0] for point in r["curve"]] == [0, 3, 6]
        assert len(r["steps"]) == 6 and all("is_ratio_mean" in s and "grad_norm" in s for s in r["steps"])
        assert r["code"] and r["seed"] == 0 and not (tmp_path / "work" / "runs" / r["run_id"] / "weights").exists()
    assert set(results["modes"]) == {"async S=1", "colocated"} and "async S=1 vs colocated" in results["verdict"]
    assert results["modes"]["async S=1"]["cost_usd"]["mean"] > 0
    assert (tmp_path / "parity-quick.png").stat().st_size > 10_000
