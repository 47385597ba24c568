"""The trainer's judging room: whether a decoded rollout group is trained on.

One ordered list of checks (`Judge.checks`), each looking at the group as a `Case` and answering
with a `Verdict` (why it is not trained, whether that is a strike, whether it is merely stale),
or None to let it through to the next. The cheap checks come first, the verifiers (in their
budgeted child process) last. A group through them all is `Accepted`, with the trainer's own
rewards. A new check is one method and one entry in the list. The proof of sampling comes after,
on the accepted groups of a step together (`prove`: a version's groups in one forward), or from
the step's own forward for the version it trains from.

The judge decides and counts nothing: the intake (workers/trainer/intake.py) tallies its
verdicts, ends the grants and strikes the samplers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cached_property

from echo.fleet.staleness import Freshness, freshness
from echo.train.learner import Rewarded
from echo.trust.proof import SamplingProof
from echo.trust.scorer import Scored, Scorer, completion_keys, content_hash, repeats
from echo.wire.messages import RolloutGroup
from streams.inbox import Delivery
from workers.trainer.scoring import ScoringProcess


@dataclass(frozen=True)
class Verdict:
    """Why a group is not trained."""

    reason: str
    detail: str = ""
    strike: bool = False  # no honest sampler of the run earns it: its sampler is struck
    stale_by: int | None = None  # not refused but dropped as stale: this many versions behind the trainer's


@dataclass
class Accepted(Rewarded):
    """A group the judge takes: the learner's record (group, the trainer's rewards, content key),
    with what the step's metrics and strikes read of its scoring."""

    reward_mismatch: bool = False  # the sampler claimed other rewards than the verifier's (a strike)
    source: str = ""  # its prompt's data source (a dataset's; else "")
    verifier_errors: int = 0  # completions whose verifier raised (reward 0)
    unanswered: int = 0  # completions in which the verifier found no answer
    close: int = 0  # of those, the ones with the true answer in their text

    @cached_property
    def keys(self) -> list[int]:
        """Its completion_keys, hashed once for the step's Taken and the run's AlreadyTrained: each
        group judged had read those of every group accepted before it in the step, O(groups^2)
        hashes of its tokens a step (at 64 groups of 16 x 4k tokens, 0.4 s of the trainer's CPU)."""
        return completion_keys(self.group)


@dataclass
class Case:
    """One group before the judge, and what the checks learn of it on the way."""

    group: RolloutGroup
    version: int  # the trainer's, now
    prompt: int | None  # the prompt its slot was granted with; None: no slot granted its sampler
    taken: Taken = field(default_factory=lambda: Taken())  # what this step took so far
    asked_with: int | None = None  # the version its sampler said it ran when granted its slot; None: not known
    noise_slot: int | None = None  # the slot whose keyed noise its slot was granted with; None: its own
    content: str = ""
    scored: Scored | None = None
    # The intake's, around the judge: the message it came in, the prompt its sampler's slot was
    # granted with (None: not on a slot of its sampler's), and the verdict (until proven, if the
    # proof wants it).
    delivery: Delivery | None = None
    granted: int | None = None
    verdict: Accepted | Verdict | None = None

    @property
    def about(self) -> str:
        return f"group {self.group.group_id} from {self.group.sampler_id}"


@dataclass(frozen=True)
class Timeline:
    """Which versions' groups this trainer may train on."""

    max_staleness: int
    term: int = 0  # this trainer's term (streams/lease.py)
    # The version it resumed from: an earlier term's versions up to that one are this
    # timeline's too; later ones came from a checkpoint since discarded.
    resumed_from: int = 0
    begun_within: int | None = None  # a partial rollout's first tokens (EchoConfig.begun_within); None: max_staleness


@dataclass
class AlreadyTrained:
    """What the run has trained on, as far as a new group could repeat it."""

    content: set[str] = field(default_factory=set)  # content hashes: the same groups under new ids are replays
    completions: set[int] = field(default_factory=set)  # completion_keys of the groups trained

    def add(self, accepted: list[Accepted]) -> None:
        for a in accepted:
            self.content.add(a.content)
            self.completions.update(a.keys)


@dataclass
class Taken(AlreadyTrained):
    """What a step has taken so far (accepted, or waiting for its proof), as a new group may
    repeat it: its groups' ids too."""

    group_ids: set[str] = field(default_factory=set)

    def add(self, accepted: list[Accepted]) -> None:
        super().add(accepted)
        self.group_ids.update(a.group.group_id for a in accepted)

    def remove(self, accepted: list[Accepted]) -> None:
        """No longer taken (its proof is in, or it was proved forged): a group resending it is
        judged as it was, its forgery struck again. Within a step no two taken groups share an
        id, a content or an unlikely completion, so removing one's keys removes only its own."""
        for a in accepted:
            self.content.discard(a.content)
            self.completions.difference_update(a.keys)
            self.group_ids.discard(a.group.group_id)


class Judge:
    def __init__(self, scorer: Scorer, timeline: Timeline, trained: AlreadyTrained | None = None,
                 proof: SamplingProof | None = None, check_many=None, scoring: ScoringProcess | None = None):
        self.scorer, self.timeline = scorer, timeline
        self.trained = trained or AlreadyTrained()
        self.proof = proof
        self.check_many = check_many or (proof.check_many if proof else None)  # the proof's forwards (every rank)
        self.limits = scorer.limits  # what a message may hold, checked before it is read
        self.scoring = scoring  # the verifiers with a budget, in a child process; None: here (tests)
        # The proof of sampling is not one of them: the intake proves the groups through them all
        # together (prove), or the step from its own forward.
        # Stale before new: a late group of a lost slot whose prompt was drawn again with the
        # same noise (echo/fleet/grants.py) repeats what was trained in its place, and is merely stale.
        self.checks = [self.well_formed, self.fresh, self.new, self.on_its_slot, self.scored]

    async def judge(self, case: Case) -> Accepted | Verdict:
        for check in self.checks:
            verdict = await check(case)
            if verdict is not None:
                return verdict
        scored = case.scored
        return Accepted(case.group, scored.rewards, case.content, scored.reward_mismatch, scored.source,
                        scored.verifier_errors, scored.unanswered, scored.close)

    async def well_formed(self, case: Case) -> Verdict | None:
        """What the run's config rules out (group size, temperature, tokens, task, precision): no
        honest sampler of the run sends it."""
        reason = self.scorer.malformed(case.group)
        return Verdict(reason, case.about, strike=True) if reason else None

    async def new(self, case: Case) -> Verdict | None:
        """Not a group, or completions, trained before or taken this step (resent under a new id)."""
        group = case.group
        if group.group_id in case.taken.group_ids:
            return Verdict("duplicate_group_id", case.about)
        case.content = content_hash(group)
        if case.content in self.trained.content or case.content in case.taken.content:
            return Verdict("replayed_content", case.about)
        if repeats(group, self.trained.completions, case.taken.completions):
            return Verdict("repeated_completion", case.about)
        return None

    async def fresh(self, case: Case) -> Verdict | None:
        """Of this timeline, and within the staleness bound of the trainer's version."""
        group, timeline, version = case.group, self.timeline, case.version
        if group.term > timeline.term:
            return Verdict("future_term", f"{group.term} > {timeline.term}")
        newest = group.newest_version  # a partial rollout's last tokens: the rest may be older
        if group.term < timeline.term and newest > timeline.resumed_from:
            return Verdict("discarded_timeline", f"version {newest} of term {group.term}")
        fresh = freshness(newest, version, timeline.max_staleness)
        begun_within = timeline.max_staleness if timeline.begun_within is None else timeline.begun_within
        if fresh is Freshness.USE and group.version < version - begun_within:
            fresh = Freshness.STALE  # begun too long ago: the proof of sampling could not read it
        if fresh is Freshness.FUTURE:
            return Verdict("future_version", f"{newest} > {version}")
        if fresh is Freshness.STALE:
            return Verdict("stale", case.about, stale_by=version - newest)
        return None

    async def on_its_slot(self, case: Case) -> Verdict | None:
        """On a slot granted its sampler, and on the prompt the grant named: the trainer, not the
        sampler, chooses what the policy learns from."""
        group = case.group
        if case.prompt is None:
            return Verdict("slot_not_held", f"slot {group.slot} from {group.sampler_id}")
        if group.prompt_index != case.prompt:  # no honest sampler of this release does it
            return Verdict("wrong_prompt", f"prompt {group.prompt_index} on slot {group.slot}, granted {case.prompt}",
                           strike=True)
        if group.keyed_slot != (case.noise_slot or group.slot):  # a redraw of its prompt is the same draw
            return Verdict("wrong_noise_slot", f"noise of slot {group.keyed_slot} on slot {group.slot}, granted "
                           f"{case.noise_slot or group.slot}", strike=True)
        if case.asked_with is not None and group.version < case.asked_with:  # weights only move forward
            return Verdict("version_not_granted", f"version {group.version} on slot {group.slot}, asked with "
                           f"{case.asked_with}", strike=True)
        return None

    async def scored(self, case: Case) -> Verdict | None:
        """The prompt is the task's, and the trainer's own verifiers score every completion (a
        multi-turn episode played again with the sampler's actions)."""
        scored = await self.scoring.score(case.group) if self.scoring else self.scorer.score(case.group)
        case.scored = scored
        if scored.reason:  # a claim the environment never made, a verifier bomb: a lie
            return Verdict(scored.reason, case.about, strike=scored.lie)
        return None

    def wants_proof(self, group: RolloutGroup, version: int) -> bool:
        """Whether the proof of sampling checks `group` before it is trained, the trainer holding
        `version` (SamplingProof.wants: every group at the default verify_fraction 1, but those
        the step proves from its own forward)."""
        return self.proof is not None and self.proof.wants(group, version)

    async def prove(self, groups: list[RolloutGroup], version: int) -> dict[str, Verdict]:
        """The proof of sampling, on accepted groups it wants (wants_proof), together: the claimed
        log-probs are the policy's, with keyed noise each token is the one the noise picks, and
        with routing replay each recorded expert one the router would choose. The groups refused
        (group id -> why): forged, a strike; unverifiable (a version that sampled it is no longer
        kept), none. Groups of the version the trainer holds are proved by the step that trains
        them (SamplingProof.in_step)."""
        checks = await asyncio.to_thread(self.check_many, groups)
        verdicts = {}
        for group in groups:
            checked, about = checks[group.group_id], f"group {group.group_id} from {group.sampler_id}"
            if checked is None:  # nothing could prove it
                verdicts[group.group_id] = Verdict("unverifiable", about)
            elif reason := self.proof.forged(group, checked):
                margin = "" if checked.margin is None else f", token margin {checked.margin:.3g}"
                routing = "" if checked.routing is None else f", routing gap {checked.routing:.3g}"
                verdicts[group.group_id] = Verdict(reason, f"{about}: log-prob gap {checked.gap:.3g}{margin}{routing}",
                                                   strike=True)
        return verdicts
