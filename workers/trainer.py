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
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import structlog

from echo.admission import GrantLedger, allowance, sampler_cap
from echo.checkpoint import TrainerState, load_checkpoint, prune_weights, save_checkpoint, weights_file
from echo.config import EchoConfig
from echo.learner import make_optimizer, set_threads, train_step
from echo.models import load_model
from echo.policy import make_policy, weights_kind, weights_shards
from echo.protocol import (
    CONFIG_KEY,
    AdmissionBudget,
    Grant,
    GrantRequest,
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
from streams.client import BROKER_ERRORS, Run, open_run
from streams.grants import serve_grants
from streams.lease import Lease, take_lease
from streams.secure import credentials_of
from streams.pull import publish_pull_request
from streams.quarantine import change_quarantine, read_quarantine, watch_quarantine
from streams.rollouts import fetch_rollouts, trainer_subscription
from streams.weights import publish_weights
from workers.background import Background

log = structlog.get_logger()


@dataclass
class Admitted:
    msg: object
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
    rejected: Counter = field(default_factory=Counter)  # malformed groups by reason
    reward_mismatch: Counter = field(default_factory=Counter)  # groups by sampler
    verifier_errors: int = 0
    already_trained: int = 0  # redelivered after a restart, skipped


class Collector:
    """Pulls rollout messages until it has enough usable groups, acking the rest at once."""

    def __init__(
        self, subscription, referee: Referee, max_staleness: int, trained_ids: set[str],
        trained_content: set[str] = frozenset(), ledger: GrantLedger | None = None,
        proof: SamplingProof | None = None, quarantine: "Quarantined | None" = None,
    ):
        self.subscription, self.referee = subscription, referee
        self.ledger = ledger or GrantLedger()  # each message received ends one grant of its sender
        self.proof, self.quarantine = proof, quarantine
        self.max_staleness = max_staleness
        self.trained_ids = trained_ids
        self.trained_content = set(trained_content)  # content hashes: the same groups under new ids are replays
        self.held: list = []  # messages fetched and not yet acked, kept alive while held

    async def collect(self, need: int, version: int, on_wait=None) -> Collected:
        out = Collected()
        while len(out.used) < need:
            msgs = await fetch_rollouts(self.subscription, need - len(out.used), timeout=1.0)
            if not msgs and on_wait is not None:
                await on_wait(need - len(out.used))
            for msg in msgs:
                admitted = self._admit(msg, version, out)
                if admitted is not None:
                    admitted = await self._check_sampling(admitted, out)
                if admitted is None:
                    await msg.ack()  # dropped or rejected: it stays in the stream for replay
                else:
                    out.used.append(admitted)
                    self.held.append(msg)
        return out

    def _admit(self, msg, version: int, out: Collected) -> Admitted | None:
        sender = subject_sampler(msg.subject)
        self.ledger.delivered(sender)
        if self.quarantine and sender in self.quarantine:
            return _reject(out, "quarantined", f"a group from {sender}")
        try:
            group = decode_rollout(msg.data, msg.headers, msg.subject)
        except ProtocolError as e:
            return _reject(out, e.reason, str(e))
        if group.group_id in self.trained_ids or any(a.group.group_id == group.group_id for a in out.used):
            out.already_trained += 1
            return None
        reason = self.referee.malformed(group)
        if reason:
            return _reject(out, reason, f"group {group.group_id} from {group.sampler_id}")
        content = content_hash(group)
        if content in self.trained_content or any(a.content == content for a in out.used):
            return _reject(out, "replayed_content", f"group {group.group_id} from {group.sampler_id}")
        verdict = judge(group.policy_version, version, self.max_staleness)
        if verdict is Verdict.FUTURE:
            return _reject(out, "future_version", f"{group.policy_version} > {version}")
        if verdict is Verdict.STALE:
            out.dropped[version - group.policy_version] += 1
            out.dropped_ids.append(group.group_id)
            out.dropped_tokens += sum(len(c.token_ids) for c in group.completions)
            return None
        judgement = self.referee.score(group)
        if judgement.reason:
            return _reject(out, judgement.reason, f"group {group.group_id} from {group.sampler_id}")
        if judgement.reward_mismatch:
            out.reward_mismatch[group.sampler_id] += 1
        out.verifier_errors += judgement.verifier_errors
        return Admitted(msg, group, judgement.rewards, content, judgement.reward_mismatch)

    async def _check_sampling(self, admitted: Admitted, out: Collected) -> Admitted | None:
        """Proof of sampling on the groups chosen for it; strikes for forgeries and claimed rewards."""
        group = admitted.group
        forged = False
        if self.proof and self.proof.wants(group):
            gap = await asyncio.to_thread(self.proof.check, group)
            forged = self.proof.forged(gap)
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

    async def ack_held(self) -> None:
        for msg in self.held:
            await msg.ack()
        self.held.clear()


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
            await change_quarantine(self.run, lambda samplers: samplers.update({sampler_id: why}))
            log.warning("sampler.quarantined", sampler=sampler_id, why=why)


class Orders:
    """How the trainer asks the samplers for groups and grants them the work, and asks again
    for groups lost in flight (a sampler that died holding a grant) when nothing arrived for a
    while. It answers every sampler's grant requests (streams/grants.py) while it runs."""

    def __init__(self, run: Run, cfg: EchoConfig, state: TrainerState, ledger: GrantLedger,
                 quarantine: Quarantined | None = None):
        self.run, self.cfg, self.state, self.ledger, self.quarantine = run, cfg, state, ledger, quarantine
        self.asked_at, self.version = 0.0, state.version
        self.fleet: set[str] = set()  # samplers that asked for work since this trainer started

    async def start(self) -> None:
        self.subscription = await serve_grants(self.run, self.grant)

    async def ask(self, version: int) -> None:
        self.version, self.asked_at = version, time.monotonic()
        await self.publish(self.cfg.trainer.groups_per_step)

    async def on_wait(self, missing: int) -> None:
        if time.monotonic() - self.asked_at > self.cfg.trainer.reissue_after_s:
            log.warning("orders.reissue", version=self.version, missing=missing)
            self.asked_at = time.monotonic()
            self.ledger.forget_held()
            await self.reissue(missing)

    async def grant(self, sampler_id: str, request: GrantRequest) -> Grant:
        """The answer to a sampler asking for work: none for a quarantined sampler or one running
        a previous trainer's weights (it must apply ours first), none yet while fewer than
        `trainer.min_samplers` have asked (ask again soon), else what the mode grants."""
        if (self.quarantine and sampler_id in self.quarantine) or request.epoch != self.run.epoch:
            return Grant(groups=0)
        if sampler_id not in self.fleet:
            self.fleet.add(sampler_id)
            log.info("trainer.sampler_joined", sampler=sampler_id, samplers=len(self.fleet))
        if len(self.fleet) < self.cfg.trainer.min_samplers:
            return Grant(groups=0, more=True)
        return await self.grant_work(sampler_id, request)


class PullRequests(Orders):
    """Sequential mode: each step asks for exactly its groups, generated with its version."""

    request: PullRequest | None = None
    granted = 0  # of the current request's groups

    async def publish(self, groups: int) -> None:
        # Current before it is published: a sampler may ask for its groups at once.
        self.request, self.granted = PullRequest(request_id=uuid.uuid4().hex, version=self.version, groups=groups), 0
        await publish_pull_request(self.run, self.request)

    async def reissue(self, missing: int) -> None:
        await self.publish(missing)

    async def grant_work(self, sampler_id: str, request: GrantRequest) -> Grant:
        current = self.request
        if current is None or request.pull_request_id != current.request_id or request.version != current.version:
            return Grant(groups=0)
        groups, more = self.ledger.grant(sampler_id, request.want, current.groups - self.granted, current.groups,
                                         time.monotonic())
        self.granted += groups
        return Grant(groups=groups, more=more)


class Admission(Orders):
    """Async mode: the admission budget, so that samplers generate no group that would arrive
    stale (echo/admission.py). Lost groups are handed out again by raising the allowance."""

    leases = 0  # granted so far in the run, by every incarnation of the trainer

    async def start(self) -> None:
        self.leases = await leases_granted(self.run)
        await super().start()

    def highest_lease(self) -> int:
        return allowance(self.version, self.cfg.trainer.max_staleness, self.cfg.trainer.groups_per_step, self.state.lost)

    async def publish(self, groups: int) -> None:
        # Samplers watch the budget to ask for work again as soon as there is some.
        budget = AdmissionBudget(version=self.version, allowance=self.highest_lease(), groups_per_step=groups)
        await publish_budget(self.run, budget)

    async def reissue(self, missing: int) -> None:
        self.state.lost += missing
        await self.publish(self.cfg.trainer.groups_per_step)

    async def grant_work(self, sampler_id: str, request: GrantRequest) -> Grant:
        if request.pull_request_id is not None or not 0 <= request.version <= self.version:
            return Grant(groups=0)
        per_step = self.cfg.trainer.groups_per_step
        cap = sampler_cap(self.version, self.highest_lease(), request.version, per_step)
        window = (self.cfg.trainer.max_staleness + 1) * per_step  # groups that may be in flight at once
        groups, more = self.ledger.grant(sampler_id, request.want, cap - self.leases, window, time.monotonic())
        if groups:
            self.leases += groups
            await record_leases_granted(self.run, self.leases)
        return Grant(groups=groups, more=more)


async def run_trainer(cfg: EchoConfig) -> None:
    set_threads(cfg.trainer.threads)
    run = await open_run(cfg.nats.url, cfg.run.id, "trainer", cfg.nats.hub_domain or None,
                         credentials=credentials_of(cfg.nats.creds, cfg.nats.tls_ca))
    try:
        lease = await take_lease(run)  # before touching the run: a second trainer stops here
    except BaseException:
        await run.close()
        raise
    try:
        async with Background() as background:
            background.start(lease.renew_forever())
            await train(cfg, run, lease, background)
    finally:
        await lease.release()
        await run.close()


async def train(cfg: EchoConfig, run: Run, lease: Lease, background: Background) -> None:
    run_dir = cfg.run_dir
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    # Samplers on other machines read the run's config here; this machine's files stay here.
    await run.state.put(CONFIG_KEY, cfg.model_dump_json(exclude={"nats": {"creds", "tls_ca"}}).encode())

    base, tokenizer = load_model(cfg.model.name)
    policy = make_policy(base, cfg.lora)
    optimizer = make_optimizer(policy, cfg)
    checkpoint_path = run_dir / "checkpoint.pt"
    state = load_checkpoint(checkpoint_path, policy, optimizer) or TrainerState()
    restore_metrics(run_dir / "metrics.jsonl", state)

    referee = Referee(load_task(cfg.task), tokenizer, base.get_input_embeddings().num_embeddings, cfg.sampling)
    max_staleness = 0 if cfg.run.mode == "sequential" else cfg.trainer.max_staleness
    subscription = await trainer_subscription(run, cfg.trainer.ack_wait_s)
    ledger, quarantine = GrantLedger(), Quarantined(run, cfg.trainer.quarantine_after)
    await quarantine.start(background)
    proof = SamplingProof(policy, tokenizer.pad_token_id, cfg.sampling.temperature, cfg.trainer.verify_fraction,
                          cfg.trainer.verify_tolerance, keep=max_staleness + 1, seed=cfg.run.seed)
    collector = Collector(subscription, referee, max_staleness, set(state.trained_ids), set(state.trained_content),
                          ledger, proof, quarantine)
    background.start(collector.keep_alive(cfg.trainer.ack_wait_s / 3))
    orders = (PullRequests if cfg.run.mode == "sequential" else Admission)(run, cfg, state, ledger, quarantine)

    # (Re)publish the current version: a fresh run's version 0, or the checkpoint's.
    await publish_policy(run, cfg, policy, state.version, run_dir)
    proof.remember(state.version)
    await orders.start()
    log.info("trainer.ready", run=cfg.run.id, mode=cfg.run.mode, model=cfg.model.name, step=state.step,
             version=state.version, steps=cfg.run.steps)
    started = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "ab") as metrics_file:
        for step in range(state.step + 1, cfg.run.steps + 1):
            step_started = time.perf_counter()
            await orders.ask(state.version)
            collected = await collector.collect(cfg.trainer.groups_per_step, state.version, orders.on_wait)
            batch = [(a.group, a.rewards) for a in collected.used]
            stats = await train_in_thread(policy, optimizer, batch, cfg, tokenizer.pad_token_id)

            groups = [a.group for a in collected.used]
            trained_at = time.perf_counter()
            state.step, state.version = step, state.version + 1
            state.trained_ids += [g.group_id for g in groups]
            collector.trained_ids.update(g.group_id for g in groups)
            state.trained_content += [a.content for a in collected.used]
            collector.trained_content.update(a.content for a in collected.used)
            state.lost += len(collected.dropped_ids) + sum(collected.rejected.values())
            state.record = {
                "step": step,
                "version": state.version,
                **stats,
                "tokens_per_second": stats["tokens"] / stats["train_seconds"],
                "learner_busy": stats["train_seconds"] / (trained_at - step_started),
                "step_seconds": trained_at - step_started,  # waiting for groups + training
                "wall_seconds": trained_at - started,  # since this trainer process started
                "used": len(groups),
                "dropped_stale": len(collected.dropped_ids),
                "dropped_tokens": collected.dropped_tokens,
                "rejected": dict(collected.rejected),
                "reward_mismatch": dict(collected.reward_mismatch),
                "verifier_errors": collected.verifier_errors,
                "already_trained": collected.already_trained,
                "proof_of_sampling": dict(proof.counts),  # groups checked so far by this process, by outcome
                "quarantined": sorted(quarantine.samplers),
                "staleness_used": dict(Counter(state.version - 1 - g.policy_version for g in groups)),
                "staleness_dropped": dict(collected.dropped),
                "groups": [[g.group_id, g.policy_version, g.sampler_id] for g in groups],
                "dropped_groups": collected.dropped_ids,
            }
            await asyncio.to_thread(save_checkpoint, checkpoint_path, policy, optimizer, state)
            lease.check()  # a trainer fenced out by another must not publish over it
            publish_seconds = await publish_policy(run, cfg, policy, state.version, run_dir)
            proof.remember(state.version)
            await collector.ack_held()  # only now: the step that used them is checkpointed

            record = {**state.record, "publish_seconds": publish_seconds}
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


async def train_in_thread(policy, optimizer, batch, cfg: EchoConfig, pad_id: int) -> dict:
    """train_step off the event loop. Cancelled (SIGTERM), it tells the step to stop at the next
    group: the process then exits in seconds instead of finishing a long step; nothing of the
    step was acked, so its groups are redelivered to the next trainer."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(train_step, policy, optimizer, batch, cfg, pad_id, stop)
    except asyncio.CancelledError:
        stop.set()
        raise


def metrics_line(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"  # histograms have int keys


def restore_metrics(path: Path, state: TrainerState) -> None:
    """After a crash, metrics.jsonl must hold exactly one line per checkpointed step: drop lines
    of steps the checkpoint does not have, and restore the last step's line if it was lost."""
    if not path.exists():
        return
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    kept = [r for r in lines if r["step"] <= state.step]
    if state.record and (not kept or kept[-1]["step"] < state.step):
        kept.append(state.record)
    if len(kept) != len(lines):
        path.write_bytes(b"".join(metrics_line(r) for r in kept))


async def publish_policy(run: Run, cfg: EchoConfig, policy, version: int, run_dir: Path) -> float:
    """Write the version's shards to the run directory (for `echo-rl eval`), then publish them.
    Both keep the newest `trainer.keep_versions` versions."""
    started = time.perf_counter()
    shards = weights_shards(policy, int(cfg.trainer.shard_mb * 2**20))
    for index, data in enumerate(shards):
        weights_file(run_dir, version, index).write_bytes(data)
    prune_weights(run_dir, version - cfg.trainer.keep_versions + 1)
    await publish_weights(run, version, shards, cfg.model.name, weights_kind(policy), cfg.trainer.keep_versions)
    return time.perf_counter() - started
