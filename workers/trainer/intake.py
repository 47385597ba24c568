"""The trainer's intake: what becomes of every rollout message it consumes.

Owns the judging of groups (decoded, well formed, this timeline's, fresh, not a replay, the
trainer's own rewards, the proof of sampling) and what a step collected. It reads deliveries
from the rollout inbox (streams/inbox.py), which holds them unacked until the process says the
step is checkpointed; it ends the grants a delivery fulfils in the ledger (echo/grants.py)
and strikes samplers through the quarantine (workers/trainer/quarantine.py). It publishes nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import structlog

from echo.consumed import ConsumedSeqs
from echo.grants import GrantLedger
from echo.protocol import ProtocolError, RolloutGroup, decode_rollout
from echo.proof import SamplingProof
from echo.referee import Referee, completion_keys, content_hash, repeats
from echo.staleness import Freshness, freshness
from streams.inbox import Delivery, RolloutInbox
from workers.trainer.quarantine import Quarantined
from workers.trainer.scoring import ScoringProcess

log = structlog.get_logger()


@dataclass
class Admitted:
    group: RolloutGroup
    rewards: list[float]  # the trainer's own, from the task's verifier
    content: str  # content_hash of the group
    reward_mismatch: bool = False  # the sampler claimed other rewards than the verifier's
    source: str = ""  # its prompt's data source (a dataset's; else "")


@dataclass
class Collected:
    used: list[Admitted] = field(default_factory=list)  # acked after the step's checkpoint
    dropped: Counter = field(default_factory=Counter)  # stale groups by age in versions
    dropped_ids: list[str] = field(default_factory=list)
    dropped_tokens: int = 0  # completion tokens generated for nothing
    generated_seconds: float = 0.0  # the samplers' time generating the used and the stale groups
    rejected: Counter = field(default_factory=Counter)  # malformed groups by reason
    reward_mismatch: Counter = field(default_factory=Counter)  # groups by sampler
    verifier_errors: int = 0
    already_counted: int = 0  # offered again after a crash, counted when first consumed
    seqs: list[int] = field(default_factory=list)  # stream sequences of every message consumed and counted


@dataclass(frozen=True)
class Timeline:
    """Which versions' groups this trainer may train on."""

    max_staleness: int
    epoch: int = 0  # this trainer incarnation's epoch (streams/lease.py)
    # The version it resumed from: an earlier incarnation's versions up to that one are this
    # timeline's too; later ones came from a checkpoint since discarded.
    resumed_from: int = 0
    begun_within: int | None = None  # a partial rollout's first tokens (EchoConfig.begun_within); None: max_staleness


class Judge:
    """Whether a group may be trained on, counting in a step's Collected what happened to it."""

    def __init__(self, referee: Referee, timeline: Timeline, trained_content=frozenset(), trained_completions=frozenset(),
                 proof: SamplingProof | None = None, check=None, quarantine: Quarantined | None = None,
                 scoring: ScoringProcess | None = None):
        self.referee, self.timeline = referee, timeline
        self.trained_content = set(trained_content)  # content hashes: the same groups under new ids are replays
        self.trained_completions = set(trained_completions)  # completion_keys of the groups trained
        self.proof, self.quarantine = proof, quarantine
        self.check = check or (proof.check if proof else None)  # the proof's forward (on every rank)
        self.limits = referee.limits  # what a message may hold, checked before it is read
        self.scoring = scoring  # the verifiers with a budget, in a child process; None: here (tests)

    async def admit(self, group: RolloutGroup, sender: str, version: int, out: Collected,
                    prompt: int | None) -> Admitted | None:
        """`prompt`: the one its slot was granted with; None: not a slot granted its sender."""
        reason = self.referee.malformed(group)
        if reason:  # the run's config says otherwise: no honest sampler of the run sends it
            return await self.refuse(out, sender, reason, f"group {group.group_id} from {group.sampler_id}")
        content = self._screen(group, sender, version, out)
        if content is None:  # rejected, or stale: trained on nothing, whatever its prompt
            return None
        if prompt is None:  # no slot of its sender's: its prompt would be its own choice
            return reject(out, "slot_not_held", f"slot {group.slot} from {sender}")
        if group.prompt_index != prompt:  # no honest sampler of this release does it
            return await self.refuse(out, sender, "wrong_prompt",
                                     f"prompt {group.prompt_index} on slot {group.slot}, granted {prompt}")
        ruling = await self.scoring.score(group) if self.scoring else self.referee.score(group)
        if ruling.reason and ruling.lie:  # a claim the environment never made, a verifier bomb
            return await self.refuse(out, sender, ruling.reason, f"group {group.group_id} from {group.sampler_id}")
        if ruling.reason:
            return reject(out, ruling.reason, f"group {group.group_id} from {group.sampler_id}")
        if ruling.reward_mismatch:
            out.reward_mismatch[group.sampler_id] += 1
        out.verifier_errors += ruling.verifier_errors
        out.generated_seconds += group.gen_seconds
        return await self._check_sampling(Admitted(group, ruling.rewards, content, ruling.reward_mismatch, ruling.source), out)

    def _screen(self, group: RolloutGroup, sender: str, version: int, out: Collected) -> str | None:
        """The checks that run no verifier: the group's content hash if it passes them, else None
        (rejected, or dropped as stale: counted in `out`)."""
        if any(a.group.group_id == group.group_id for a in out.used):
            return reject(out, "duplicate_group_id", f"group {group.group_id} from {group.sampler_id}")
        content = content_hash(group)
        if content in self.trained_content or any(a.content == content for a in out.used):
            return reject(out, "replayed_content", f"group {group.group_id} from {group.sampler_id}")
        if repeats(group, self.trained_completions, {k for a in out.used for k in completion_keys(a.group)}):
            return reject(out, "repeated_completion", f"group {group.group_id} from {group.sampler_id}")
        timeline = self.timeline
        if group.epoch > timeline.epoch:
            return reject(out, "future_epoch", f"{group.epoch} > {timeline.epoch}")
        newest = group.newest_version  # a partial rollout's last tokens: the rest may be older
        if group.epoch < timeline.epoch and newest > timeline.resumed_from:
            return reject(out, "discarded_timeline", f"version {newest} of epoch {group.epoch}")
        fresh = freshness(newest, version, timeline.max_staleness)
        begun_within = timeline.max_staleness if timeline.begun_within is None else timeline.begun_within
        if fresh is Freshness.USE and group.policy_version < version - begun_within:
            fresh = Freshness.STALE  # begun too long ago: the proof of sampling could not read it
        if fresh is Freshness.FUTURE:
            return reject(out, "future_version", f"{newest} > {version}")
        if fresh is Freshness.STALE:
            out.dropped[version - newest] += 1
            out.dropped_ids.append(group.group_id)
            out.dropped_tokens += sum(len(c.token_ids) for c in group.completions)
            out.generated_seconds += group.gen_seconds
            return None
        return content

    def ignores(self, sender: str, out: Collected) -> bool:
        """Whether `sender` is quarantined: its messages are counted and acked unread."""
        if self.quarantine is None or sender not in self.quarantine:
            return False
        out.rejected["quarantined"] += 1  # not logged one by one: a quarantined flood would fill the log
        return True

    async def refuse(self, out: Collected, sender: str, reason: str, detail: str) -> None:
        """Reject a message no honest sampler sends, and strike its sender."""
        reject(out, reason, detail)
        if self.quarantine:
            await self.quarantine.strike(sender, reason)

    async def _check_sampling(self, admitted: Admitted, out: Collected) -> Admitted | None:
        """Proof of sampling on the groups chosen for it; strikes for forgeries and claimed rewards."""
        group = admitted.group
        forged = False
        if self.proof and self.proof.wants(group):
            gap = await asyncio.to_thread(self.check, group)
            forged = self.proof.forged(group, gap)
        if self.quarantine and (forged or admitted.reward_mismatch):
            await self.quarantine.strike(group.sampler_id, "logprob_forgery" if forged else "reward_mismatch")
        if forged:
            return reject(out, "logprob_forgery", f"group {group.group_id} from {group.sampler_id}: gap {gap:.3g}")
        return admitted


class Collector:
    """Pulls rollout messages until it has enough usable groups. Every message consumed (used,
    dropped or rejected) stays held in the inbox until the step is checkpointed: a crash
    redelivers them all, and each is counted once, in the step that checkpointed it (`consumed`)."""

    def __init__(self, inbox: RolloutInbox, judge: Judge, ledger: GrantLedger | None = None,
                 consumed: ConsumedSeqs | None = None):
        self.inbox, self.judge = inbox, judge
        self.ledger = ledger or GrantLedger()  # a group naming its sender's slot ends that slot
        self.consumed = consumed or ConsumedSeqs()  # stream sequences counted by checkpointed steps

    async def collect(self, need: int, version: int, on_wait=None) -> Collected:
        out = Collected()
        while len(out.used) < need:
            deliveries = await self.inbox.fetch(need - len(out.used), timeout=1.0)
            if not deliveries and on_wait is not None:
                await on_wait(need - len(out.used))
            for delivery in deliveries:
                if delivery.seq in self.consumed or delivery.seq in out.seqs:
                    # Offered again: a crash came between its step's checkpoint and its ack, or the
                    # broker restarted and lost the state of this step's deliveries.
                    out.already_counted += 1
                    self.inbox.let_go(delivery)
                    continue
                out.seqs.append(delivery.seq)
                admitted = await self._admit(delivery, version, out)
                if admitted is not None:
                    out.used.append(admitted)
                else:
                    self.inbox.let_go(delivery)
        return out

    async def _admit(self, delivery: Delivery, version: int, out: Collected) -> Admitted | None:
        """The group to train on, or None (counted in `out` by what happened to it). Only a group
        on one of its sender's slots, on the prompt granted with it, is judged; one that is not
        trained wastes that slot."""
        if self.judge.ignores(delivery.sender, out):
            return None
        try:
            limits = self.judge.limits
            group = decode_rollout(await self.inbox.body(delivery, limits), delivery.headers, delivery.subject, limits)
        except ProtocolError as e:  # junk, or a sampler of another release: either way nothing to train
            return await self.judge.refuse(out, delivery.sender, e.reason, str(e))
        granted = self.ledger.delivered(delivery.sender, group.slot, delivery.arrived)
        prompt = granted if granted is not None else self.ledger.earlier_prompt(group.slot, group.prompt_index)
        admitted = await self.judge.admit(group, delivery.sender, version, out, prompt)
        if granted is not None:  # a wasted slot's prompt is owed
            (self.ledger.wasted if admitted is None else self.ledger.accepted)(group.slot)
        return admitted

    def trained(self, collected: Collected) -> None:
        """The step that collected these is checkpointed: their sequences and contents are counted."""
        self.consumed.add(collected.seqs)
        self.judge.trained_content.update(a.content for a in collected.used)
        for admitted in collected.used:
            self.judge.trained_completions.update(completion_keys(admitted.group))


def reject(out: Collected, reason: str, detail: str) -> None:
    out.rejected[reason] += 1
    log.warning("rollout.rejected", reason=reason, detail=detail)
    return None
