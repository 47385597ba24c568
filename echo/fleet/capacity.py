"""ECHO-2's overlap capacity model: which samplers keep the learner busy within the staleness
bound, and which do it cheapest. Pure: no I/O; docs/operations.md derives it ("Scheduling").

The learner takes a step in T seconds once its B groups are there (training and publishing).
Sampler i applies a new version D_i seconds after it is announced, then generates in calls of
g_i seconds at r_i groups per second. Step s + 1 starts when version s is published and takes
groups of versions s - S and newer (echo-rl's staleness: age = the trainer's current version
minus the group's; S = 0 is on-policy). In a steady cycle of C >= T seconds, version s - S was
published S * C seconds before step s + 1 starts and the learner waits W = C - T for groups,
so sampler i can start useful calls during (S + 1) * C - T - D_i - g_i seconds and delivers

    u_i(C) = r_i * min(C, (S + 1) * C - T - D_i)   groups per cycle, if D_i + g_i <= (S + 1) * C - T,
    u_i(C) = 0                                                     otherwise (its groups arrive stale).

The cycle is the least C >= T with sum_i u_i(C) >= B, and the learner's utilisation is T / C.
It never waits (C = T) when every active sampler delivers in time at the learner's own pace,
D_i + g_i <= S * T, and together they deliver sum_i r_i * min(T, S * T - D_i) >= B groups, which
is sum_i r_i >= B / T when each syncs within (S - 1) * T. (ECHO-2 counts the step being trained
as well, which reads D_i + g_i <= (S + 1) * T in its numbering: its S is echo-rl's S - 1.)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from statistics import mean
from typing import Annotated

from pydantic import ConfigDict, Field, with_config

from echo.wire.messages import SamplerStatus

SCHEDULED = ("active", "standby")  # a draining or quarantined sampler is not the scheduler's to use
EXACT_UP_TO = 12  # samplers: every subset is tried up to here (4096), a greedy heuristic beyond
TOLERANCE = 1e-9


# Each field's bounds are checked where a fleet file is read (workers/operator/plan.py), not at
# every construction here.
@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class LearnerPace:
    step_s: Annotated[float, Field(gt=0)]  # T: one step's training and publishing, measured
    groups_per_step: Annotated[int, Field(ge=1)]  # B
    max_staleness: Annotated[int, Field(ge=0)]  # S


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class SamplerPace:
    id: str
    groups_per_s: Annotated[float, Field(ge=0)]  # r_i, measured over a sliding window
    sync_s: Annotated[float, Field(ge=0)]  # D_i: from a version's announcement to the sampler running it
    call_s: Annotated[float, Field(gt=0)]  # g_i: one generation call, from its start to its groups published
    cost_per_hour: Annotated[float, Field(ge=0)] = 0.0
    device: str = ""


def sampler_pace(status: SamplerStatus) -> SamplerPace:
    """A registry entry as the model's sampler: its sync time is the mean over its last versions."""
    return SamplerPace(status.sampler_id, status.groups_per_s, mean(status.sync_s.values()) if status.sync_s else 0.0,
                       status.call_s or math.inf, status.cost_per_hour, status.device)


@dataclass(frozen=True)
class Plan:
    learner: LearnerPace
    active: tuple[str, ...]
    cycle_s: float  # C: seconds per step
    utilisation: float  # T / C
    cost_per_hour: float
    cost_per_step: float
    reached: bool  # the target utilisation
    exact: bool  # every subset tried (else the greedy heuristic)
    reasons: dict[str, str] = field(default_factory=dict)  # sampler -> why chosen or not


def delivers_in_time(sampler: SamplerPace, learner: LearnerPace, cycle_s: float | None = None) -> bool:
    """Whether the sampler's groups can be fresh for a step, the learner stepping every cycle_s (T)."""
    cycle = learner.step_s if cycle_s is None else cycle_s
    return sampler.sync_s + sampler.call_s <= (learner.max_staleness + 1) * cycle - learner.step_s + TOLERANCE


def groups_per_cycle(sampler: SamplerPace, learner: LearnerPace, cycle_s: float) -> float:
    """u_i(C): the groups the sampler delivers in time for one step, steps coming every cycle_s."""
    if not delivers_in_time(sampler, learner, cycle_s):
        return 0.0
    window = (learner.max_staleness + 1) * cycle_s - learner.step_s - sampler.sync_s
    return sampler.groups_per_s * min(cycle_s, window)


def cycle_seconds(learner: LearnerPace, samplers: list[SamplerPace]) -> float:
    """C: the least cycle >= T at which the samplers deliver a step's groups (inf: never)."""
    def enough(cycle: float) -> bool:
        return sum(groups_per_cycle(w, learner, cycle) for w in samplers) >= learner.groups_per_step - TOLERANCE

    if enough(learner.step_s):
        return learner.step_s
    if not any(w.groups_per_s > 0 for w in samplers):
        return math.inf
    low, high = learner.step_s, 2 * learner.step_s
    while not enough(high):  # delivery grows without bound with the cycle: this ends
        low, high = high, 2 * high
    while high - low > 1e-6 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def utilisation(learner: LearnerPace, samplers: list[SamplerPace]) -> float:
    return learner.step_s / cycle_seconds(learner, samplers)


def _evaluate(learner: LearnerPace, chosen: list[SamplerPace], target: float, exact: bool) -> Plan:
    cycle = cycle_seconds(learner, chosen)
    hourly = sum(w.cost_per_hour for w in chosen)
    per_step = hourly * cycle / 3600 if math.isfinite(cycle) else math.inf
    return Plan(learner, tuple(w.id for w in chosen), cycle, learner.step_s / cycle, hourly, per_step,
                learner.step_s / cycle >= target - TOLERANCE, exact)


def _better(a: Plan, b: Plan | None) -> bool:
    """Reaching the target first; then the lower cost per step; then fewer samplers."""
    if b is None:
        return True
    if a.reached != b.reached:
        return a.reached
    if not a.reached:
        return a.utilisation > b.utilisation + TOLERANCE
    if abs(a.cost_per_step - b.cost_per_step) > TOLERANCE:
        return a.cost_per_step < b.cost_per_step
    return len(a.active) < len(b.active)


def cheapest(learner: LearnerPace, samplers: list[SamplerPace], target: float, keep: tuple[str, ...] = (),
             margin: float = 0.0) -> Plan:
    """The set of samplers that reaches `target` utilisation at the lowest cost per step (every
    subset up to EXACT_UP_TO samplers; greedy beyond). If no set reaches it, the one that comes
    closest, with `reached` False: not enough throughput at any cost.

    Hysteresis: the set `keep` (the one chosen before, those of it still here) stays while it
    reaches the target at no more than (1 + margin) times the cheapest set's cost per step, so
    that measured rates wobbling about a tie do not swap samplers back and forth."""
    if not 0 < target <= 1:
        raise ValueError(f"target utilisation {target}: between 0 (excluded) and 1")
    if len(samplers) <= EXACT_UP_TO:
        best = None
        for n in range(1, len(samplers) + 1):
            for subset in itertools.combinations(samplers, n):
                plan = _evaluate(learner, list(subset), target, exact=True)
                if _better(plan, best):
                    best = plan
        best = best or _evaluate(learner, [], target, exact=True)
    else:
        best = _greedy(learner, samplers, target)
    standby = f"standby: the target {target:.0%} is reached at lower cost without it"
    if kept := [w for w in samplers if w.id in keep]:
        current = _evaluate(learner, kept, target, best.exact)
        if (current.reached and best.reached and current.active != best.active
                and current.cost_per_step <= best.cost_per_step * (1 + margin) + TOLERANCE):
            best = current
            standby = f"standby: the active set reaches the target {target:.0%} within {margin:.0%} of the cheapest's cost"
    return replace(best, reasons=_reasons(learner, samplers, best, target, standby))


def _greedy(learner: LearnerPace, samplers: list[SamplerPace], target: float) -> Plan:
    """Workers by cost per group they deliver at the target's pace, added until the target is
    reached, then any that the others can do without dropped, the costliest first."""
    pace = learner.step_s / target
    useful = [w for w in samplers if groups_per_cycle(w, learner, pace) > 0] or list(samplers)
    order = sorted(useful, key=lambda w: w.cost_per_hour / max(groups_per_cycle(w, learner, pace), TOLERANCE))
    chosen: list[SamplerPace] = []
    for sampler in order:
        chosen.append(sampler)
        if _evaluate(learner, chosen, target, exact=False).reached:
            break
    for sampler in sorted(chosen, key=lambda w: -w.cost_per_hour):
        rest = [w for w in chosen if w is not sampler]
        if rest and _evaluate(learner, rest, target, exact=False).reached:
            chosen = rest
    return _evaluate(learner, chosen, target, exact=False)


def _reasons(learner: LearnerPace, samplers: list[SamplerPace], plan: Plan, target: float, standby: str) -> dict[str, str]:
    reasons = {}
    for w in samplers:
        late = w.sync_s + w.call_s
        if w.id in plan.active:
            reasons[w.id] = f"active: {groups_per_cycle(w, learner, plan.cycle_s):.2f} groups per step"
        elif not delivers_in_time(w, learner, plan.cycle_s):
            bound = (learner.max_staleness + 1) * plan.cycle_s - learner.step_s
            reasons[w.id] = (f"too late for S={learner.max_staleness}: sync {w.sync_s:.2f} s + call {w.call_s:.2f} s "
                             f"= {late:.2f} s > {bound:.2f} s")
        elif not plan.reached:
            reasons[w.id] = "not in the set that comes closest to the target"
        else:
            reasons[w.id] = standby
    return reasons


def best_staleness(learner: LearnerPace, samplers: list[SamplerPace], target: float, max_staleness: int) -> list[Plan]:
    """The cheapest plan at each S from 0 to `max_staleness`, cheapest per step first (those that
    reach the target before those that do not; then the smaller S)."""
    plans = [cheapest(replace(learner, max_staleness=s), samplers, target) for s in range(max_staleness + 1)]
    return sorted(plans, key=lambda p: (not p.reached, p.cost_per_step if p.reached else -p.utilisation,
                                        p.learner.max_staleness))


def replan_reason(used: dict[str, SamplerPace], now: dict[str, SamplerPace], drift: float) -> str | None:
    """Why the set chosen from the samplers `used` no longer holds for the samplers there are
    `now`: one joined, one left, or one's measured rates moved by more than `drift` (a
    fraction); None if it holds."""
    if joined := sorted(now.keys() - used.keys()):
        return f"joined: {', '.join(joined)}"
    if left := sorted(used.keys() - now.keys()):
        return f"left: {', '.join(left)}"
    for worker_id, old in sorted(used.items()):
        new = now[worker_id]
        for name in ("groups_per_s", "sync_s", "call_s"):
            before, after = getattr(old, name), getattr(new, name)
            if abs(after - before) > drift * max(abs(before), 1e-3):
                return f"{worker_id}'s {name} moved from {before:.3g} to {after:.3g}"
    return None

