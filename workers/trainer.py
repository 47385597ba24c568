"""The trainer process: consume rollout groups, take GRPO steps, publish each new version.

Step s trains on groups whose policy version is within the staleness bound of version s - 1
and publishes version s. In sequential mode it first asks the samplers for exactly the groups
it needs, generated with its current version.

Exactly once: a step's groups are acked only after the checkpoint holding that step is on disk.
After a crash the trainer resumes from the checkpoint; groups it had not acked come back from
the stream, and any it already trained on (their ids are in the checkpoint) are skipped.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import structlog

from echo.admission import GrantLedger, Heartbeats, allowance, sampler_cap
from echo.checkpoint import TrainerState, append_trained_content, load_trained_content, read_metrics
from echo.config import EchoConfig
from echo.consumed import ConsumedSeqs
from echo.logs import bind_process
from echo.protocol import (
    CONFIG_KEY,
    AdmissionBudget,
    Grant,
    GrantRequest,
    LearnerStatus,
    ProtocolError,
    PullRequest,
    RolloutGroup,
    decode_rollout,
    subject_sampler,
)
from echo.proof import SamplingProof
from echo.referee import Referee, content_hash
from echo.staleness import Verdict, judge
from echo.tasks import load_task
from streams.admission import leases_granted, publish_budget, record_leases_granted
from streams.registry import heartbeat, put_learner
from streams.client import BROKER_ERRORS, Run, open_run, until_done
from streams.grants import serve_grants
from streams.lease import Lease, take_lease
from streams.secure import credentials_of
from streams.pull import publish_pull_request
from streams.quarantine import change_quarantine, read_quarantine, watch_quarantine
from streams.rollouts import fetch_rollouts, rollout_body, trainer_subscription
from streams.weights import publish_weights
from workers.background import Background
from workers.coordinator import Coordinator
from workers.trainer_ranks import Learner, Ranks

log = structlog.get_logger()

ACK_ATTEMPTS = 3  # a held message's ack is confirmed, or left for the broker to offer again
PACE_STEPS = 10  # the learner status averages this many steps


@dataclass
class Admitted:
    group: RolloutGroup
    rewards: list[float]  # the trainer's own, from the task's verifier
    content: str  # content_hash of the group
    reward_mismatch: bool = False  # the sampler claimed other rewards than the verifier's


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




class Collector:
    """Pulls rollout messages until it has enough usable groups. Every message consumed (used,
    dropped or rejected) is held unacked until the step is checkpointed: a crash redelivers
    them all, and each is counted once, in the step that checkpointed it (`consumed`)."""

    def __init__(
        self, subscription, referee: Referee, max_staleness: int, consumed: ConsumedSeqs | None = None,
        trained_content: set[str] = frozenset(), ledger: GrantLedger | None = None,
        proof: SamplingProof | None = None, quarantine: "Quarantined | None" = None,
        epoch: int = 0, resumed_from: int = 0, check=None, bodies=None,
    ):
        self.subscription, self.referee = subscription, referee
        self.bodies = bodies  # async msg -> encoded group: reads a large group's parts (rollout_body)
        self.check = check or (proof.check if proof else None)  # the proof's forward (on every rank)
        self.ledger = ledger or GrantLedger()  # a group naming its sender's lease ends that lease
        self.proof, self.quarantine = proof, quarantine
        self.max_staleness = max_staleness
        self.consumed = consumed or ConsumedSeqs()  # stream sequences counted by checkpointed steps
        # This trainer's epoch, and the version it resumed from: an earlier incarnation's versions
        # up to that one are this timeline's too; later ones came from a checkpoint since discarded.
        self.epoch, self.resumed_from = epoch, resumed_from
        self.trained_content = set(trained_content)  # content hashes: the same groups under new ids are replays
        self.held: list = []  # messages fetched and not yet acked, kept alive while held

    async def collect(self, need: int, version: int, on_wait=None) -> Collected:
        out = Collected()
        while len(out.used) < need:
            msgs = await fetch_rollouts(self.subscription, need - len(out.used), timeout=1.0)
            if not msgs and on_wait is not None:
                await on_wait(need - len(out.used))
            for msg in msgs:
                self.held.append(msg)  # acked after the checkpoint, used or not; it stays in the stream for replay
                seq = msg.metadata.sequence.stream
                if seq in self.consumed or seq in out.seqs:
                    # Offered again: a crash came between its step's checkpoint and its ack, or the
                    # broker restarted and lost the state of this step's deliveries.
                    out.already_counted += 1
                    continue
                out.seqs.append(seq)
                admitted = await self._admit(msg, version, out)
                if admitted is not None:
                    out.used.append(admitted)
        return out

    async def _admit(self, msg, version: int, out: Collected) -> Admitted | None:
        """The group to train on, or None (counted in `out` by what happened to it). A group
        that ended one of its sender's leases and is not trained wastes that lease."""
        sender = subject_sampler(msg.subject)
        try:
            data = await self.bodies(msg) if self.bodies else msg.data
            group = decode_rollout(data, msg.headers, msg.subject)
        except ProtocolError as e:
            return _reject(out, e.reason, str(e))
        leased = self.ledger.delivered(sender, group.lease, time.monotonic())
        admitted = self._judge(group, sender, version, out)
        if admitted is not None:
            admitted = await self._check_sampling(admitted, out)
        if admitted is None and leased:
            self.ledger.wasted(group.lease)
        return admitted

    def _judge(self, group: RolloutGroup, sender: str, version: int, out: Collected) -> Admitted | None:
        if self.quarantine and sender in self.quarantine:
            return _reject(out, "quarantined", f"a group from {sender}")
        if any(a.group.group_id == group.group_id for a in out.used):
            return _reject(out, "duplicate_group_id", f"group {group.group_id} from {group.sampler_id}")
        reason = self.referee.malformed(group)
        if reason:
            return _reject(out, reason, f"group {group.group_id} from {group.sampler_id}")
        content = content_hash(group)
        if content in self.trained_content or any(a.content == content for a in out.used):
            return _reject(out, "replayed_content", f"group {group.group_id} from {group.sampler_id}")
        if group.epoch > self.epoch:
            return _reject(out, "future_epoch", f"{group.epoch} > {self.epoch}")
        if group.epoch < self.epoch and group.policy_version > self.resumed_from:
            return _reject(out, "discarded_timeline", f"version {group.policy_version} of epoch {group.epoch}")
        verdict = judge(group.policy_version, version, self.max_staleness)
        if verdict is Verdict.FUTURE:
            return _reject(out, "future_version", f"{group.policy_version} > {version}")
        if verdict is Verdict.STALE:
            out.dropped[version - group.policy_version] += 1
            out.dropped_ids.append(group.group_id)
            out.dropped_tokens += sum(len(c.token_ids) for c in group.completions)
            out.generated_seconds += group.gen_seconds
            return None
        judgement = self.referee.score(group)
        if judgement.reason:
            return _reject(out, judgement.reason, f"group {group.group_id} from {group.sampler_id}")
        if judgement.reward_mismatch:
            out.reward_mismatch[group.sampler_id] += 1
        out.verifier_errors += judgement.verifier_errors
        out.generated_seconds += group.gen_seconds
        return Admitted(group, judgement.rewards, content, judgement.reward_mismatch)

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
            return _reject(out, "logprob_forgery", f"group {group.group_id} from {group.sampler_id}: gap {gap:.3g}")
        return admitted

    async def keep_alive(self, every: float) -> None:
        """Tell the server the held messages are still being worked on, so a long step does not
        get them redelivered, while a crashed trainer's are redelivered after one ack_wait."""
        while True:
            await asyncio.sleep(every)
            try:
                for msg in self.held:
                    await msg.in_progress()
            except BROKER_ERRORS as e:  # a broker restart: the next round tells it again
                log.warning("trainer.keep_alive_failed", reason=repr(e))

    async def ack_held(self) -> int:
        """Ack every held message, waiting for the broker to confirm each; returns how many it
        did not. Those are offered again (after a broker restart, acks for deliveries made
        before it go unanswered) and skipped then: their sequences are counted already."""
        unconfirmed = 0
        for msg in self.held:
            for attempt in range(ACK_ATTEMPTS):
                try:
                    await msg.ack_sync(timeout=1.0)
                    break
                except BROKER_ERRORS as e:
                    log.warning("trainer.ack_failed", seq=msg.metadata.sequence.stream, reason=repr(e), attempt=attempt)
            else:
                unconfirmed += 1
        self.held.clear()
        return unconfirmed


def _reject(out: Collected, reason: str, detail: str) -> None:
    out.rejected[reason] += 1
    log.warning("rollout.rejected", reason=reason, detail=detail)
    return None


class Quarantined:
    """Samplers whose groups are acked and ignored and who are granted no work: caught forging
    log-probs or claiming rewards more than `trainer.quarantine_after` times. Kept in KV, where
    an operator lifts it (`echo-rl quarantine lift`): the trainer follows the key."""

    def __init__(self, run: Run, after: int):
        self.run, self.after = run, after
        self.samplers: dict[str, str] = {}
        self.strikes: Counter[str] = Counter()

    async def start(self, background: Background) -> None:
        self.samplers = await read_quarantine(self.run)
        background.start(watch_quarantine(self.run, self._changed))

    def _changed(self, samplers: dict[str, str]) -> None:
        for lifted in self.samplers.keys() - samplers.keys():
            self.strikes.pop(lifted, None)  # a fresh start
        self.samplers = samplers

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self.samplers

    async def strike(self, sampler_id: str, reason: str) -> None:
        self.strikes[sampler_id] += 1
        if self.strikes[sampler_id] > self.after and sampler_id not in self.samplers:
            why = f"{self.strikes[sampler_id]} strikes, the last {reason}"
            self.samplers[sampler_id] = why
            await until_done("quarantine", lambda: change_quarantine(
                self.run, lambda samplers: samplers.update({sampler_id: why})))
            log.warning("sampler.quarantined", sampler=sampler_id, why=why)


class Orders:
    """How the trainer asks the samplers for groups and grants them the work (numbered leases,
    streams/grants.py, answered while it runs), and hands out again the work of leases lost:
    groups that arrived and were not trained, and the leases of a sampler whose heartbeat
    stopped (`trainer.sampler_dead_after_s`) or that delivered nothing for
    `trainer.reissue_after_s` (alive but stuck)."""

    def __init__(self, run: Run, cfg: EchoConfig, state: TrainerState, ledger: GrantLedger,
                 quarantine: Quarantined | None = None):
        self.run, self.cfg, self.state, self.ledger, self.quarantine = run, cfg, state, ledger, quarantine
        self.version = state.version
        self.fleet: set[str] = set()  # samplers that asked for work since this trainer started
        self.heartbeats = Heartbeats()
        self.standby: set[str] = set()  # the scheduler's (workers/coordinator.py): granted no work

    async def start(self) -> None:
        self.ledger.issued = await leases_granted(self.run)  # a restarted trainer numbers on
        self.subscription = await serve_grants(self.run, self.grant)

    async def ask(self, version: int) -> None:
        self.version = version
        self.reissue_lost(self.ledger.take_lost())
        await self.publish(self.cfg.trainer.groups_per_step)

    async def on_wait(self, missing: int) -> None:
        """Waiting for groups: release the leases of stopped, dead or stalled holders, then hand
        out again whatever was lost."""
        now = time.monotonic()
        for sampler_id in sorted(self.ledger.holders()):
            try:
                revision, status = await heartbeat(self.run, sampler_id)
            except BROKER_ERRORS as e:  # the broker restarting: the next wait reads them again
                log.warning("orders.heartbeat_unread", sampler=sampler_id, reason=repr(e))
                return
            self.heartbeats.observe(sampler_id, revision, now)
            stopped = status is not None and status.state == "draining"  # its last heartbeat: it abandoned them
            silent_s = self.heartbeats.silent_for(sampler_id, now)
            stalled_s = now - self.ledger.progress_at[sampler_id]
            dead = silent_s > self.cfg.trainer.sampler_dead_after_s or stalled_s > self.cfg.trainer.reissue_after_s
            if stopped or dead:
                leases = self.ledger.release(sampler_id)
                log.warning("orders.leases_released", sampler=sampler_id, leases=len(leases), stopped=stopped,
                            silent_s=round(silent_s, 1), stalled_s=round(stalled_s, 1))
        lost = self.ledger.take_lost()
        if lost:
            log.warning("orders.reissue", version=self.version, lost=len(lost), missing=missing)
            self.reissue_lost(lost)
            await until_done("hand out lost work", lambda: self.republish(missing))

    async def grant(self, sampler_id: str, request: GrantRequest) -> Grant:
        """The answer to a sampler asking for work: none for a quarantined sampler or one running
        a previous trainer's weights (it must apply ours first), none yet while fewer than
        `trainer.min_samplers` have asked (ask again soon), else what the mode grants."""
        if (self.quarantine and sampler_id in self.quarantine) or request.epoch != self.run.epoch:
            return Grant()
        if sampler_id in self.standby:
            return Grant()
        if sampler_id not in self.fleet:
            self.fleet.add(sampler_id)
            log.info("trainer.sampler_joined", sampler=sampler_id, samplers=len(self.fleet))
        if len(self.fleet) < self.cfg.trainer.min_samplers:
            return Grant(more=True)
        leases, more = self.grant_work(sampler_id, request)
        if leases:
            try:
                await record_leases_granted(self.run, self.ledger.issued)
            except BROKER_ERRORS as e:  # a restarted trainer could number them again: not handed over
                log.warning("orders.grant_unrecorded", sampler=sampler_id, leases=len(leases), reason=repr(e))
                self.ledger.revoke(leases)
                return Grant(more=True)
        return Grant(leases=leases, more=more)


class PullRequests(Orders):
    """Sequential mode: each step asks for exactly its groups, generated with its version."""

    request: PullRequest | None = None
    granted = 0  # of the current request's groups
    first_lease = 0  # the current request's leases are numbered from here

    async def publish(self, groups: int) -> None:
        # Current before it is published: a sampler may ask for its groups at once.
        self.request, self.granted = PullRequest(request_id=uuid.uuid4().hex, epoch=self.run.epoch,
                                                  version=self.version, groups=groups), 0
        self.first_lease = self.ledger.issued + 1
        await publish_pull_request(self.run, self.request)

    def reissue_lost(self, lost: list[int]) -> None:
        # Only the current request's leases matter: older requests' groups are not wanted.
        self.granted -= sum(1 for lease in lost if lease >= self.first_lease)

    async def republish(self, missing: int) -> None:
        # The same request again: samplers that were told it was all given out ask once more.
        await publish_pull_request(self.run, self.request)

    def grant_work(self, sampler_id: str, request: GrantRequest) -> tuple[list[int], bool]:
        current = self.request
        if current is None or request.pull_request_id != current.request_id or request.version != current.version:
            return [], False
        leases, more = self.ledger.grant(sampler_id, request.want, current.groups - self.granted, current.groups,
                                         time.monotonic())
        self.granted += len(leases)
        return leases, more


class Admission(Orders):
    """Async mode: the admission budget, so that samplers generate no group that would arrive
    stale (echo/admission.py). Lost leases are handed out again by raising the allowance."""

    async def start(self) -> None:
        await super().start()
        # A restarted trainer cannot know which of its predecessor's leases are still out: it
        # counts every one not trained as lost, opening a fresh window. Their groups, should
        # they still come, are trained if fresh.
        self.state.lost = max(0, self.ledger.issued - self.state.version * self.cfg.trainer.groups_per_step)

    def highest_lease(self) -> int:
        return allowance(self.version, self.cfg.trainer.max_staleness, self.cfg.trainer.groups_per_step, self.state.lost)

    async def publish(self, groups: int) -> None:
        # Samplers watch the budget to ask for work again as soon as there is some.
        budget = AdmissionBudget(version=self.version, allowance=self.highest_lease(), groups_per_step=groups)
        await publish_budget(self.run, budget)

    def reissue_lost(self, lost: list[int]) -> None:
        self.state.lost += len(lost)

    async def republish(self, missing: int) -> None:
        await self.publish(self.cfg.trainer.groups_per_step)

    def grant_work(self, sampler_id: str, request: GrantRequest) -> tuple[list[int], bool]:
        if request.pull_request_id is not None or not 0 <= request.version <= self.version:
            return [], False
        per_step = self.cfg.trainer.groups_per_step
        cap = sampler_cap(self.version, self.highest_lease(), request.version, per_step)
        window = (self.cfg.trainer.max_staleness + 1) * per_step  # groups that may be in flight at once
        return self.ledger.grant(sampler_id, request.want, cap - self.ledger.issued, window, time.monotonic())


async def run_trainer(cfg: EchoConfig, ranks: Ranks) -> None:
    learner = Learner(cfg, ranks)  # the other ranks load theirs meanwhile (follow_rank_0)
    try:
        run = await open_run(cfg.nats.url, cfg.run.id, "trainer", cfg.nats.hub_domain or None,
                             credentials=credentials_of(cfg.nats.creds, cfg.nats.tls_ca), storage=cfg.nats.storage())
        try:
            lease = await take_lease(run)  # before touching the run: a second trainer stops here
        except BaseException:
            await run.close()
            raise
        try:
            async with Background() as background:
                background.start(lease.renew_forever())
                await train(cfg, run, lease, background, learner)
        finally:
            await lease.release()
            await run.close()
    finally:
        learner.close()


async def train(cfg: EchoConfig, run: Run, lease: Lease, background: Background, learner: Learner) -> None:
    run_dir = cfg.run_dir
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    # Samplers on other machines read the run's config here; this machine's files stay here.
    await run.state.put(CONFIG_KEY, cfg.model_dump_json(exclude={"nats": {"creds", "tls_ca"}}).encode())

    state, proof = learner.state, learner.proof
    restore_metrics(run_dir, state)
    referee = Referee(load_task(cfg.task), learner.tokenizer, learner.vocab_size, cfg.sampling)
    max_staleness = 0 if cfg.run.mode == "sequential" else cfg.trainer.max_staleness
    subscription = await trainer_subscription(run, cfg.trainer.ack_wait_s)
    consumed = ConsumedSeqs(**state.consumed)
    state.totals = await count_abandoned(subscription, consumed, state.totals)
    ledger, quarantine = GrantLedger(), Quarantined(run, cfg.trainer.quarantine_after)
    await quarantine.start(background)
    collector = Collector(subscription, referee, max_staleness, consumed,
                          load_trained_content(run_dir, state.trained_content), ledger, proof, quarantine,
                          run.epoch, state.version, check=learner.check,
                          bodies=functools.partial(rollout_body, run.js, run.names))
    background.start(collector.keep_alive(cfg.trainer.ack_wait_s / 3))
    orders = (PullRequests if cfg.run.mode == "sequential" else Admission)(run, cfg, state, ledger, quarantine)
    pace = Pace(cfg.trainer.groups_per_step, max_staleness)
    if cfg.scheduler.enabled:  # what it chooses, the grants obey
        background.start(Coordinator(run, cfg, orders.standby, pace).run_forever())

    # (Re)publish the current version: a fresh run's version 0, or the checkpoint's.
    await publish_policy(run, cfg, learner, state.version)
    await orders.start()
    log.info("trainer.ready", run=cfg.run.id, mode=cfg.run.mode, model=cfg.model.name, step=state.step,
             version=state.version, steps=cfg.run.steps, ranks=learner.ranks.world)
    started = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "ab") as metrics_file:
        for step in range(state.step + 1, cfg.run.steps + 1):
            step_started = time.perf_counter()
            await until_done("ask for groups", lambda: orders.ask(state.version))
            collected = await collector.collect(cfg.trainer.groups_per_step, state.version, orders.on_wait)
            collected_at = time.perf_counter()
            batch = [(a.group, a.rewards) for a in collected.used]
            stats = await train_in_thread(learner, batch)
            await asyncio.sleep(cfg.trainer.throttle_s)  # a slower learner, when asked

            groups = [a.group for a in collected.used]
            trained_at = time.perf_counter()
            state.step, state.version = step, state.version + 1
            collector.consumed.add(collected.seqs)
            state.consumed = collector.consumed.as_dict()
            state.totals = count_consumed(state.totals, collected)
            append_trained_content(run_dir, [a.content for a in collected.used])
            state.trained_content += len(collected.used)
            collector.trained_content.update(a.content for a in collected.used)
            state.record = {
                "step": step,
                "version": state.version,
                **stats,
                "tokens_per_second": stats["tokens"] / stats["train_seconds"],
                "step_seconds": trained_at - step_started,  # waiting for groups + training
                "wait_seconds": collected_at - step_started,  # for groups (and refereeing them)
                "wall_seconds": trained_at - started,  # since this trainer process started
                "used": len(groups),
                "dropped_stale": len(collected.dropped_ids),
                "dropped_tokens": collected.dropped_tokens,
                "generated_seconds": collected.generated_seconds,
                "rejected": dict(collected.rejected),
                "reward_mismatch": dict(collected.reward_mismatch),
                "verifier_errors": collected.verifier_errors,
                "already_counted": collected.already_counted,
                "proof_of_sampling": dict(proof.counts),  # groups checked so far by this process, by outcome
                "quarantined": sorted(quarantine.samplers),
                "staleness_used": dict(Counter(state.version - 1 - g.policy_version for g in groups)),
                "staleness_dropped": dict(collected.dropped),
                "groups": [[g.group_id, g.policy_version, g.sampler_id] for g in groups],
                "dropped_groups": collected.dropped_ids,
            }
            await asyncio.to_thread(learner.save, state)
            lease.check()  # a trainer fenced out by another must not publish over it
            publish_seconds = await publish_policy(run, cfg, learner, state.version)
            unconfirmed = await collector.ack_held()  # only now: the step that consumed them is checkpointed

            accounting = await until_done(
                "account", lambda: account(subscription, state.totals, collector.consumed, unconfirmed))
            # Everything but the wait: T of the capacity model (echo/capacity.py), and the share
            # of the step it is (what `echo-rl status` shows over the last steps).
            busy = time.perf_counter() - collected_at
            record = {**state.record, "publish_seconds": publish_seconds, "accounting": accounting,
                      "busy_seconds": busy, "learner_busy": busy / (busy + state.record["wait_seconds"])}
            status = pace.add(record, state.version)
            await until_done("learner status", lambda: put_learner(run, status))
            metrics_file.write(metrics_line(record))
            metrics_file.flush()
            log.info(
                "step",
                step=step,
                version=state.version,
                reward=round(stats["reward_mean"], 3),
                used=len(groups),
                stale=record["dropped_stale"],
                busy=f"{record['learner_busy']:.0%}",
                seconds=round(record["step_seconds"], 2),
            )


class Pace:
    """The trainer's LearnerStatus over its last PACE_STEPS steps."""

    def __init__(self, groups_per_step: int, max_staleness: int):
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.steps: deque[tuple[float, float]] = deque(maxlen=PACE_STEPS)  # (busy, wait) seconds
        self.rewards: deque[float] = deque(maxlen=PACE_STEPS)
        self.rejected: Counter = Counter()  # by reason, since this trainer started
        self.status: LearnerStatus | None = None  # after the last step

    def add(self, record: dict, version: int) -> LearnerStatus:
        self.steps.append((record["busy_seconds"], record["wait_seconds"]))
        self.rewards.append(record["reward_mean"])
        self.rejected.update(record["rejected"])
        busy, wait = (sum(column) for column in zip(*self.steps))
        self.status = LearnerStatus(
            step_s=busy / len(self.steps), groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
            version=version, utilisation=busy / (busy + wait) if busy + wait > 0 else 1.0, updated_at=time.time(),
            step=record["step"], rewards=list(self.rewards), publish_s=record["publish_seconds"],
            accounting=record["accounting"], rejected=dict(self.rejected))
        return self.status


def count_consumed(totals: dict[str, int], collected: Collected) -> dict[str, int]:
    """The run's messages so far by what became of them (checkpointed with the step)."""
    return {
        **totals,
        "trained": totals.get("trained", 0) + len(collected.used),
        "dropped_stale": totals.get("dropped_stale", 0) + len(collected.dropped_ids),
        "rejected": totals.get("rejected", 0) + sum(collected.rejected.values()),
    }


async def count_abandoned(subscription, consumed: ConsumedSeqs, totals: dict[str, int]) -> dict[str, int]:
    """Messages the broker has acked that this trainer's checkpoint never counted: a previous
    incarnation consumed them in a timeline whose checkpoint is gone (the run restarted from an
    older checkpoint, or a wiped run directory on a broker that kept its streams). They are
    counted as `abandoned`, once."""
    acked = (await subscription.consumer_info()).ack_floor.stream_seq
    abandoned = consumed.missing_through(acked)
    if not abandoned:
        return totals
    log.warning("trainer.rewound", abandoned=abandoned, checkpoint_floor=consumed.floor, broker_ack_floor=acked)
    consumed.raise_floor(acked)
    return {**totals, "abandoned": totals.get("abandoned", 0) + abandoned}


async def account(subscription, totals: dict[str, int], consumed: ConsumedSeqs, unconfirmed: int) -> dict[str, int]:
    """Every message published on the run's rollouts stream is trained, dropped as stale,
    rejected, or still pending (not acked): `published = trained + dropped_stale + rejected +
    pending`, and `counted` (distinct messages counted) equals the first three (each once).
    One consumer info gives published and pending at the same instant. After a broker crash
    the broker may offer counted messages again (`unconfirmed` acks, or state it lost): until
    they are skipped, they are in `pending` too."""
    info = await subscription.consumer_info()
    consumed.raise_floor(info.ack_floor.stream_seq)
    return {"published": info.delivered.stream_seq + info.num_pending, **totals,
            "pending": info.num_pending + info.num_ack_pending, "counted": len(consumed),
            "unconfirmed_acks": unconfirmed}


async def train_in_thread(learner: Learner, batch) -> dict:
    """A step off the event loop. Cancelled (SIGTERM), it tells the step to stop at the next
    pass: the process then exits in seconds instead of finishing a long step; nothing of the
    step was acked, so its groups are redelivered to the next trainer."""
    learner.stop.clear()
    try:
        return await asyncio.to_thread(learner.train, batch)
    except asyncio.CancelledError:
        learner.stop.set()
        raise


def metrics_line(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"  # histograms have int keys


def restore_metrics(run_dir: Path, state: TrainerState) -> None:
    """After a crash, metrics.jsonl must hold exactly one line per checkpointed step: drop lines
    of steps the checkpoint does not have, and restore the last step's line if it was lost. A
    restored line says so; what came after the checkpoint (publishing, accounting) is not in it,
    and its busy time is the step's training only."""
    path = run_dir / "metrics.jsonl"
    lines = read_metrics(run_dir)
    kept = [r for r in lines if r["step"] <= state.step]
    if state.record and (not kept or kept[-1]["step"] < state.step):
        record, busy = state.record, state.record["step_seconds"] - state.record["wait_seconds"]
        kept.append({**record, "busy_seconds": busy, "learner_busy": busy / record["step_seconds"], "restored": True})
    cut_short = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    if len(kept) != len(lines) or cut_short:  # a line cut short would run into the next one appended
        path.write_bytes(b"".join(metrics_line(r) for r in kept))


async def publish_policy(run: Run, cfg: EchoConfig, learner: Learner, version: int) -> float:
    """Write the version's shards to the run directory (for `echo-rl eval`), then publish them
    from there (a retry reads them again). Both keep the newest `trainer.keep_versions` versions
    (the bucket, for `trainer.keep_versions_s` more: what a slow sampler's fetch may take)."""
    started = time.perf_counter()
    files = await asyncio.to_thread(learner.write_weights, version)
    await until_done("publish weights", lambda: publish_weights(
        run, version, (f.read_bytes() for f in files), learner.base_model, learner.kind, cfg.trainer.keep_versions,
        cfg.trainer.keep_versions_s))
    await asyncio.to_thread(learner.remember, version)
    bind_process(version=version)  # this trainer's log lines name the version it last published
    return time.perf_counter() - started
