"""The capacity model (echo/fleet/capacity.py) on fleets small enough to compute by hand."""

from dataclasses import replace

import pytest

from echo.fleet.capacity import (
    LearnerPace,
    SamplerPace,
    _better,
    _evaluate,
    best_staleness,
    cheapest,
    cycle_seconds,
    replan_reason,
    utilisation,
)


def test_an_on_policy_sampler_makes_the_learner_wait_for_its_sync_and_generation():
    # S = 0: after each publish the sampler syncs (1 s) and generates 2 groups at 0.5/s (4 s):
    # a cycle is 3 + 1 + 4 = 8 s, the learner busy 3/8 of it.
    learner = LearnerPace(step_s=3, groups_per_step=2, max_staleness=0)
    sampler = SamplerPace("w", groups_per_s=0.5, sync_s=1, call_s=2)
    assert cycle_seconds(learner, [sampler]) == pytest.approx(8, rel=1e-5)
    assert utilisation(learner, [sampler]) == pytest.approx(3 / 8, rel=1e-5)
    assert utilisation(learner, [sampler]) < 1  # it waits


def test_with_enough_fresh_throughput_the_learner_never_waits_and_the_cheapest_pair_is_chosen():
    # S = 2, T = 2 s, B = 4: each sampler delivers r * min(T, S*T - D) = 1 * min(2, 3.5) = 2
    # groups per step, so any two keep the learner busy; one alone: min(C, 3C - 2.5) >= 4 at C = 4.
    learner = LearnerPace(step_s=2, groups_per_step=4, max_staleness=2)
    a, b, c = (SamplerPace(name, 1.0, 0.5, 1.0, cost) for name, cost in [("a", 3.0), ("b", 1.0), ("c", 2.0)])
    assert utilisation(learner, [a, b]) == 1.0 and utilisation(learner, [a, b, c]) == 1.0
    assert cycle_seconds(learner, [a]) == pytest.approx(4, rel=1e-5)
    plan = cheapest(learner, [a, b, c], target=1.0)
    assert plan.reached and plan.exact and set(plan.active) == {"b", "c"}
    assert plan.cost_per_step == pytest.approx(3.0 * 2 / 3600)
    assert plan.reasons["a"].startswith("standby")


def test_not_enough_throughput_at_any_cost_is_said_and_the_closest_set_given():
    # S = 1, T = 1, B = 8: both samplers together deliver 2 groups per second: C = 4 s, 25% busy.
    learner = LearnerPace(step_s=1, groups_per_step=8, max_staleness=1)
    samplers = [SamplerPace(name, 1.0, 0.1, 0.5, 1.0) for name in ("a", "b")]
    plan = cheapest(learner, samplers, target=0.9)
    assert not plan.reached and set(plan.active) == {"a", "b"}
    assert plan.utilisation == pytest.approx(0.25, rel=1e-5)


def test_a_fast_cheap_worker_behind_a_slow_link_is_excluded():
    # Its groups would arrive 5 + 0.5 s after a version: later than (S+1) * T - T = 2 s.
    learner = LearnerPace(step_s=2, groups_per_step=2, max_staleness=1)
    far = SamplerPace("far", groups_per_s=2.0, sync_s=5.0, call_s=0.5, cost_per_hour=1.0)
    near = SamplerPace("near", groups_per_s=1.5, sync_s=0.2, call_s=1.0, cost_per_hour=2.0)
    plan = cheapest(learner, [far, near], target=1.0)
    assert plan.active == ("near",) and plan.reached
    assert plan.reasons["far"] == "too late for S=1: sync 5.00 s + call 0.50 s = 5.50 s > 2.00 s"


def test_a_cheap_slow_worker_only_helps_at_a_larger_staleness_bound():
    # Its calls take 4 s (4.8 groups each): 4.2 s after a version, within (S+1)T - T = S*T from S = 3.
    learner = LearnerPace(step_s=2, groups_per_step=2, max_staleness=1)
    premium = SamplerPace("premium", groups_per_s=1.5, sync_s=0.2, call_s=1.0, cost_per_hour=4.0)
    cheap = SamplerPace("cheap", groups_per_s=1.2, sync_s=0.2, call_s=4.0, cost_per_hour=1.0)
    assert cheapest(learner, [premium, cheap], 1.0).active == ("premium",)
    plans = best_staleness(learner, [premium, cheap], target=1.0, max_staleness=4)
    assert [p.learner.max_staleness for p in plans] == [3, 4, 1, 2, 0]  # cheapest first, then never reached
    best = plans[0]
    assert best.active == ("cheap",) and best.cost_per_step == pytest.approx(1.0 * 2 / 3600)
    assert plans[1].active == ("cheap",) and [p.active for p in plans[2:4]] == [("premium",), ("premium",)]
    assert not plans[4].reached  # on-policy, the learner always waits for a sync and a call


def test_the_active_set_is_kept_while_it_reaches_the_target_within_the_switch_margin():
    # Any two of three keep the learner busy (as above); b + c is cheapest at 3 an hour.
    learner = LearnerPace(step_s=2, groups_per_step=4, max_staleness=2)
    a, b, c = (SamplerPace(name, 1.0, 0.5, 1.0, cost) for name, cost in [("a", 3.2), ("b", 1.0), ("c", 3.0)])
    assert set(cheapest(learner, [a, b, c], 1.0).active) == {"b", "c"}  # 4.0 an hour; a + b: 4.2
    # a + b costs 4.2 against 4.0: within 10%, kept; within 1%, not.
    kept = cheapest(learner, [a, b, c], 1.0, keep=("a", "b"), margin=0.1)
    assert set(kept.active) == {"a", "b"} and kept.reasons["c"].startswith("standby: the active set reaches")
    assert set(cheapest(learner, [a, b, c], 1.0, keep=("a", "b"), margin=0.01).active) == {"b", "c"}
    # A kept set that does not reach the target is not kept, whatever the margin: one of it
    # left (a alone is 50% busy), or its rates fell.
    assert set(cheapest(learner, [a, b, c], 1.0, keep=("a",), margin=10.0).active) == {"b", "c"}
    slow_a = replace(a, groups_per_s=0.2)
    assert set(cheapest(learner, [slow_a, b, c], 1.0, keep=("a", "b"), margin=10.0).active) == {"b", "c"}


def test_between_sets_of_equal_cost_the_smaller_is_better():
    # a alone delivers 2 x min(2, 3.5) = 4 groups a step, b and c 2 each: both sets keep the
    # learner busy at 2 an hour. Fewer samplers: fewer to sync and to fail.
    learner = LearnerPace(step_s=2, groups_per_step=4, max_staleness=2)
    a, b, c = SamplerPace("a", 2.0, 0.5, 1.0, 2.0), SamplerPace("b", 1.0, 0.5, 1.0, 1.0), SamplerPace("c", 1.0, 0.5, 1.0, 1.0)
    alone, pair = (_evaluate(learner, chosen, 1.0, exact=True) for chosen in ([a], [b, c]))
    assert alone.reached and pair.reached and alone.cost_per_step == pytest.approx(pair.cost_per_step)
    assert _better(alone, pair) and not _better(pair, alone)


def test_beyond_a_dozen_workers_a_greedy_plan_reaches_the_target_with_the_cheapest():
    learner = LearnerPace(step_s=2, groups_per_step=6, max_staleness=2)
    samplers = [SamplerPace(f"w{i:02d}", 1.0, 0.5, 1.0, cost_per_hour=1.0 + i) for i in range(14)]
    plan = cheapest(learner, samplers, target=1.0)
    assert not plan.exact and plan.reached
    assert plan.active == ("w00", "w01", "w02")  # 2 groups per step each


def test_a_target_utilisation_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="target utilisation 1.5"):
        cheapest(LearnerPace(1, 1, 1), [SamplerPace("a", 1, 0, 1)], 1.5)


def test_the_set_is_chosen_again_when_a_worker_joins_leaves_or_its_rates_drift():
    a, b = SamplerPace("a", 1.0, 0.5, 1.0), SamplerPace("b", 2.0, 0.5, 1.0)
    used = {"a": a, "b": b}
    assert replan_reason(used, {"a": a, "b": b}, drift=0.25) is None
    assert replan_reason(used, {"a": a, "b": replace(b, groups_per_s=2.4)}, 0.25) is None  # 20%: noise
    assert replan_reason(used, {"a": a, "b": replace(b, groups_per_s=1.4)}, 0.25) == "b's groups_per_s moved from 2 to 1.4"
    assert replan_reason(used, {"a": a}, 0.25) == "left: b"
    assert replan_reason(used, {**used, "c": a}, 0.25) == "joined: c"

