"""The trainer's intake: what becomes of every rollout message it consumes.

It reads deliveries from the rollout inbox (streams/inbox.py), which holds them unacked until the
process says the step is checkpointed; decodes each within the run's limits; hands the group to
the judge (workers/trainer/judge.py) with the prompt its slot was granted with; and tallies
the verdict in what the step collected, ends the grant in the ledger (echo/fleet/grants.py) and
strikes the sampler through the quarantine (workers/trainer/strikes.py). It publishes nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from echo.fleet.consumed import ConsumedSeqs
from echo.fleet.grants import GrantLedger
from echo.train.diagnosis import no_signal
from echo.train.learner import Batch
from echo.wire.codec import ProtocolError
from streams.inbox import Delivery, RolloutInbox
from workers.trainer.judge import Accepted, Case, Judge, Taken, Verdict
from workers.trainer.strikes import Quarantined

log = structlog.get_logger()


@dataclass
class Collected:
    used: list[Accepted] = field(default_factory=list)  # acked after the step's checkpoint
    taken: Taken = field(default_factory=Taken)  # what a group judged next must not repeat
    dropped: Counter = field(default_factory=Counter)  # stale groups by age in versions
    dropped_ids: list[str] = field(default_factory=list)
    dropped_tokens: int = 0  # completion tokens generated for nothing
    # Dynamic sampling (algorithm.dynamic_sampling): groups whose rewards were all equal, set
    # aside for others (acked with the step, not trained): each cost a grant and its generation.
    filtered: int = 0
    filtered_by: Counter = field(default_factory=Counter)  # of them, by sampler: each has its share of the budget
    filtered_tokens: int = 0
    generated_seconds: float = 0.0  # the samplers' time generating the used and the stale groups
    proof_seconds: float = 0.0  # the proof of sampling's forwards here (Judge.prove), within the wait for groups
    rejected: Counter = field(default_factory=Counter)  # refused groups by reason
    rejected_tokens: int = 0  # completion tokens of the refused groups that decoded (an honest one's: slot released)
    reward_mismatch: Counter = field(default_factory=Counter)  # groups by sampler
    verifier_errors: int = 0
    already_counted: int = 0  # offered again after a crash, counted when first consumed
    seqs: list[int] = field(default_factory=list)  # stream sequences of every message consumed and counted

    def batch(self, oldest_version: int, step: int) -> Batch:
        """What the learner trains on as step `step`: each accepted group with the trainer's own rewards."""
        return Batch(list(self.used), oldest_version, step)


class Tally:
    """What becomes of each judged group, tallied in the step's Collected: trained (held in the
    inbox until the step's checkpoint), set aside, dropped as stale or refused (let go); its slot
    ended in the ledger, its sampler struck through the quarantine where the verdict says so."""

    def __init__(self, inbox: RolloutInbox, ledger: GrantLedger, quarantine: Quarantined | None, set_aside: int):
        self.inbox, self.ledger, self.quarantine = inbox, ledger, quarantine
        self.set_aside = set_aside  # groups with no signal a step sets aside at most (dynamic sampling; 0: none)

    async def settle(self, case: Case, out: Collected) -> None:
        """Tally a group's final verdict in `out`: trained (held in the inbox until the step's
        checkpoint), set aside, dropped as stale or refused (let go). A group not trained
        wastes its slot, and its prompt is owed."""
        group, verdict, granted = case.group, case.verdict, case.granted
        tokens = sum(len(c.token_ids) for c in group.completions)  # generated, where it is not trained
        if granted is not None:
            (self.ledger.accepted if isinstance(verdict, Accepted) else self.ledger.wasted)(group.slot)
        if isinstance(verdict, Verdict):
            if verdict.stale_by is not None:
                out.dropped[verdict.stale_by] += 1
                out.dropped_ids.append(group.group_id)
                out.dropped_tokens += tokens
                out.generated_seconds += group.gen_seconds
            else:
                out.rejected_tokens += tokens
                await self.refused(out, group.sampler_id, verdict)
            self.inbox.let_go(case.delivery)
            return
        out.generated_seconds += group.gen_seconds
        out.verifier_errors += verdict.verifier_errors
        if verdict.reward_mismatch:
            out.reward_mismatch[group.sampler_id] += 1
            await self.strike(group.sampler_id, "reward_mismatch")
        if no_signal(verdict.rewards) and self.may_set_aside(group.sampler_id, out):
            out.filtered += 1  # acked with the step: consumed, not trained
            out.filtered_by[group.sampler_id] += 1
            out.filtered_tokens += tokens
            if granted is not None:
                self.ledger.set_aside(group.slot)
            self.inbox.let_go(case.delivery)
            return
        out.used.append(verdict)
        out.taken.add([verdict])

    def may_set_aside(self, sampler_id: str, out: Collected) -> bool:
        """Dynamic sampling's budget has room, and `sampler_id` has used no more than its share of it
        (an equal part among the samplers asking): one sampler's groups with no signal cannot
        spend the step's set-aside budget for everyone (theirs are trained past it, as no budget)."""
        share = self.ledger.share(self.set_aside, time.monotonic())
        return out.filtered < self.set_aside and out.filtered_by[sampler_id] < share

    async def refuse_forged(self, out: Collected, forged: dict[str, str]) -> None:
        """Groups the step's own forward proved forged (group id -> why): refused and struck as
        any forgery, their prompts owed, their messages still counted by the step (acked with it)."""
        for accepted in [a for a in out.used if a.group.group_id in forged]:
            out.used.remove(accepted)
            out.taken.remove([accepted])
            self.ledger.owe(accepted.group.prompt_index, accepted.group.keyed_slot)
            out.generated_seconds -= accepted.group.gen_seconds
            out.verifier_errors -= accepted.verifier_errors
            await self.refused(out, accepted.group.sampler_id,
                                Verdict(forged[accepted.group.group_id], f"group {accepted.group.group_id} from "
                                        f"{accepted.group.sampler_id}, proved in its step", strike=True))

    async def refused(self, out: Collected, sampler_id: str, verdict: Verdict) -> None:
        out.rejected[verdict.reason] += 1
        log.warning("rollout.rejected", reason=verdict.reason, detail=verdict.detail)
        if verdict.strike:
            await self.strike(sampler_id, verdict.reason)

    async def strike(self, sampler_id: str, reason: str) -> None:
        if self.quarantine is not None:
            await self.quarantine.strike(sampler_id, reason)


class Collector:
    """Pulls rollout messages until it has enough usable groups. Every message consumed (used,
    dropped or rejected) stays held in the inbox until the step is checkpointed: a crash
    redelivers them all, and each is counted once, in the step that checkpointed it (`consumed`)."""

    def __init__(self, inbox: RolloutInbox, judge: Judge, ledger: GrantLedger | None = None,
                 consumed: ConsumedSeqs | None = None, quarantine: Quarantined | None = None, set_aside: int = 0):
        self.inbox, self.judge, self.quarantine = inbox, judge, quarantine
        self.ledger = ledger or GrantLedger()  # a group naming its sampler's slot ends that slot
        self.consumed = consumed or ConsumedSeqs()  # stream sequences counted by checkpointed steps
        self.tally = Tally(inbox, self.ledger, quarantine, set_aside)

    async def collect(self, need: int, version: int, on_wait=None, into: Collected | None = None) -> Collected:
        """Until `need` groups are usable (`into` holds those collected so far). The groups the
        proof of sampling wants are proven together (Judge.prove: a version swapped in once),
        once there are enough to fill the step or the stream has no more for now."""
        out, proving = into or Collected(), []
        while len(out.used) < need:
            deliveries = await self.inbox.fetch(need - len(out.used) - len(proving), timeout=1.0)
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
                case = await self._judge(delivery, version, out)
                if case is None:
                    self.inbox.let_go(delivery)
                elif isinstance(case.verdict, Accepted) and self.judge.wants_proof(case.group, version):
                    proving.append(case)
                    out.taken.add([case.verdict])  # taken while it waits for its proof
                else:
                    await self.tally.settle(case, out)
            if proving and (len(out.used) + len(proving) >= need or not deliveries):
                started = time.perf_counter()
                verdicts = await self.judge.prove([c.group for c in proving], version)
                out.proof_seconds += time.perf_counter() - started
                out.taken.remove([c.verdict for c in proving])  # waiting no more: settled below, taken if used
                for case in proving:
                    case.verdict = verdicts.get(case.group.group_id, case.verdict)
                    await self.tally.settle(case, out)
                proving = []
            for sampler_id in self.ledger.take_withholders():  # found here or by the granter's releases
                record = self.ledger.deliveries[sampler_id]
                log.warning("grants.undelivered", sampler=sampler_id, undelivered=record.undelivered, ended=record.ended)
                await self.tally.strike(sampler_id, "slots_undelivered")
        return out

    async def _judge(self, delivery: Delivery, version: int, out: Collected) -> Case | None:
        """A delivery's case with the judge's verdict but for the proof of sampling (against what
        the step took so far, `out.taken`), or None for a message not judged (tallied by
        Tally.refused, or its sampler quarantined). A group on one of its sampler's slots ends it."""
        if self.quarantine is not None and delivery.sampler_id in self.quarantine:
            out.rejected["quarantined"] += 1  # not logged one by one: a quarantined flood would fill the log
            return None
        try:
            group = await delivery.group(self.judge.limits)
        except ProtocolError as e:  # junk, or a sampler of another release: either way nothing to train
            await self.tally.refused(out, delivery.sampler_id, Verdict(e.reason, str(e), strike=True))
            return None
        longest = max((len(c.token_ids) for c in group.completions), default=1)
        granted = self.ledger.delivered(group.sampler_id, group.slot, delivery.arrived, longest)
        prompt = granted if granted is not None else self.ledger.earlier_prompt(group.slot, group.prompt_index)
        asked_with = self.ledger.asked_with(group.slot) if granted is not None else None
        noise_slot = self.ledger.noise_slot(group.slot) if granted is not None else group.slot  # a predecessor's: fresh
        case = Case(group, version, prompt, out.taken, asked_with, noise_slot, delivery=delivery, granted=granted)
        case.verdict = await self.judge.judge(case)
        return case

    def trained(self, collected: Collected) -> None:
        """The step that collected these is checkpointed: their sequences and contents are counted."""
        self.consumed.add(collected.seqs)
        self.judge.trained.add(collected.used)

