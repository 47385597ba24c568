"""The trainer process: consume rollout groups, take GRPO steps, publish each new version.

Step s trains on groups whose policy version is within the staleness bound of version s - 1
and publishes version s. In sequential mode it first asks the samplers for exactly the groups
it needs, generated with its current version.

Exactly once: a step's groups are acked only after the checkpoint holding that step is on disk.
After a crash the trainer resumes from the checkpoint; groups it had not acked come back from
the stream, and any it already trained on (their ids are in the checkpoint) are skipped.

This file is the process and its step loop; the other rooms of the wing: workers/trainer/__init__.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from echo.config import EchoConfig
from echo.train.checkpoint import remember_trained
from echo.train.learner import Batch
from echo.train.metrics import read_metrics, summarize
from echo.wire.messages import SlotsEnded
from streams.client import RunClient, open_run, retry_forever
from streams.credentials import credentials_of
from streams.lease import Lease, take_lease
from streams.registry import clear_finished, put_finished, put_trainer_status, read_trainer_status
from streams.run_config import publish_run_config
from streams.weights import WeightsPublisher
from workers.background import Background
from workers.trainer.accounting import (
    RecentSteps,
    count_consumed,
    finished_record,
    settle,
    step_record,
    step_samples,
)
from workers.trainer.evaluation import Evaluator
from workers.trainer.granter import Granter
from workers.trainer.intake import Collector
from workers.trainer.model import Ranks, Stepped, TrainerModel
from workers.trainer.publishing import publish_version
from workers.trainer.rooms import open_rooms
from workers.trainer.scoring import ScoringProcess, start_forkserver
from workers.trainer.shown import Shown
from workers.trainer.step import TrainerStep
from workers.trainer.trackers import Trackers

log = structlog.get_logger()


async def run_trainer(cfg: EchoConfig, ranks: Ranks) -> None:
    start_forkserver()  # what the scoring process imports loads while the model is built
    await serve(cfg, lambda: TrainerModel(cfg, ranks))  # the other ranks build theirs meanwhile (follow_rank_0)
    # Only now, every connection closed: nothing this process logs comes after the summary (a
    # connection's error callback can still fire while it closes).
    log.info("trainer.finished", run_dir=str(cfg.run_dir), **summarize(read_metrics(cfg.run_dir)))


async def serve(cfg: EchoConfig, build_model: Callable[[], TrainerModel]) -> None:
    """The run's lease taken while the model is built, and renewed; the model resumed from the
    run's checkpoint, the steps taken. A restarted trainer waits LAPSE_S (4 s) for its dead
    predecessor's lease to lapse (not at all where it sees that process has exited), a large
    model loads for longer: one wait, not both (see docs/performance.md, Recovery)."""
    run = await open_run(cfg.nats.url, cfg.run.id, "trainer", cfg.nats.hub_domain or None,
                         credentials=credentials_of(cfg.nats.creds, cfg.nats.tls_ca), storage=cfg.nats.storage())
    started = time.perf_counter()
    building = asyncio.ensure_future(asyncio.to_thread(build_model))  # refused, the process exits once it is built
    lease = model = None
    try:
        lease = await take_lease(run)  # before touching the run: a second trainer stops here
        log.info("trainer.lease_taken", term=lease.term, next="the model, built meanwhile")
        model = await building
        log.info("trainer.model_built", seconds=round(time.perf_counter() - started, 1))
        async with Background() as background, ScoringProcess.of(cfg, model.tokenizer, model.vocab_size) as scoring:
            background.start(lease.renew_forever())
            await asyncio.to_thread(model.resume)  # holding the lease: no other trainer prunes it now
            trainer = Trainer(cfg, lease, model, *await open_rooms(cfg, run, lease, background, model, scoring))
            await trainer.fit()
    except asyncio.CancelledError:  # SIGTERM or Ctrl-C (workers/arguments.py): said, as the samplers say it
        log.info("trainer.stopped", step=model.state.step if model is not None else 0, why="a signal")
        raise
    finally:
        if lease is not None:
            await lease.release()
        await run.close()
        if model is not None:
            model.close()


class Trainer:
    """The rooms a step passes through, opened once; `fit` takes the steps, phase by phase."""

    def __init__(self, cfg: EchoConfig, lease: Lease, model: TrainerModel, collector: Collector, granter: Granter,
                 recent: RecentSteps):
        self.cfg, self.run, self.lease, self.model = cfg, lease.run, lease, model
        self.collector, self.granter, self.recent = collector, granter, recent
        self.inbox, self.quarantine = collector.inbox, collector.quarantine
        self.weights = WeightsPublisher(lease, cfg.trainer.keep_versions, cfg.trainer.keep_versions_s)
        self.evaluator = Evaluator(cfg, collector.judge.scorer.task)

    async def fit(self) -> None:
        cfg, state = self.cfg, self.model.state
        await publish_version(self.weights, self.model, state.version)  # a fresh run's version 0, or the checkpoint's
        await retry_forever("clear the run's end", lambda: clear_finished(self.run))  # taken further, maybe
        await self.granter.start()
        log.info("trainer.ready", run_id=cfg.run.id, mode=cfg.run.mode, model=cfg.model.name, step=state.step,
                 version=state.version, steps=cfg.run.steps, ranks=self.model.ranks.world)
        process_started = time.perf_counter()
        trackers = await asyncio.to_thread(Trackers, cfg)  # W&B starts a process: seconds
        try:
            await self.take_steps(process_started, Shown(cfg, self.run, self.collector.judge.scorer.task, trackers))
            await asyncio.to_thread(trackers.finish, summarize(read_metrics(cfg.run_dir)))
        finally:
            await asyncio.to_thread(trackers.close)
        await mark_finished(self.run, state.step)

    async def take_steps(self, process_started: float, shown: Shown) -> None:
        cfg, state = self.cfg, self.model.state
        if cfg.run.eval_before and state.step == 0 and self.evaluator.prompts:  # the curve's first point
            await shown.evaluated(0, await asyncio.to_thread(self.evaluator.evaluate, 0, state.version))
        for number in range(state.step + 1, cfg.run.steps + 1):
            # Told to stop, no new step: a cancellation nats-py swallowed (in its flush, during the
            # step's publish) stays counted here, where the next re-cancel came 3 s (many steps) later.
            if asyncio.current_task().cancelling():
                raise asyncio.CancelledError
            step = TrainerStep(number, process_started)
            with step.phase("collect"):
                await retry_forever("ask for groups", lambda: self.granter.ask(state.version))
                step.collected = await self.collector.collect(cfg.trainer.groups_per_step, state.version,
                                                              self.granter.on_wait)
                step.batch = step.collected.batch(state.version - cfg.staleness_bound, step.number)
            with step.phase("train"):
                step.stats = await self.train_proven(step)
                await asyncio.sleep(cfg.trainer.throttle_s)  # a slower learner, when asked
            with step.phase("checkpoint"):
                await self.checkpoint(step)
            # Acking and counting wait on the broker as publishing does, and need only the
            # checkpoint: they go on meanwhile (the reasoning shape's overhead, bench.load).
            settling = asyncio.create_task(settle(self.inbox, self.collector.consumed, state.totals))
            try:
                with step.phase("publish"):
                    step.published = await publish_version(self.weights, self.model, state.version)
                with step.phase("account"):
                    record = await self.account(step, await settling)
            finally:
                settling.cancel()  # done by then, but where publishing failed
            evaluated = None
            if self.evaluator.due(step.number):
                with step.phase("evaluate"):
                    evaluated = await asyncio.to_thread(self.evaluator.evaluate, step.number, state.version)
            await shown.step(step, record, self.recent.status, sum(self.quarantine.strikes.values()), evaluated)

    async def train_proven(self, step: TrainerStep) -> dict:
        """The step trained on its batch, the groups of the version it trains from proved by its
        own forward: a forged one is refused and struck, groups are collected in its place and the
        step is taken again (no update was made)."""
        version = self.model.state.version
        while True:
            stepped = await train_in_thread(self.model, step.batch, version)
            if not stepped.forged:
                return stepped.stats
            log.warning("step.forged_groups", step=step.number, forged=stepped.forged)
            await self.collector.tally.refuse_forged(step.collected, stepped.forged)
            await self.collector.collect(self.cfg.trainer.groups_per_step, version, self.granter.on_wait,
                                         into=step.collected)
            step.batch = step.collected.batch(version - self.cfg.staleness_bound, step.number)

    async def checkpoint(self, step: TrainerStep) -> None:
        """The step, what it consumed and trained, and its metrics, on disk before anything of it is acked."""
        state, used = self.model.state, step.collected.used
        state.step, state.version = step.number, state.version + 1
        self.collector.trained(step.collected)
        state.consumed = self.collector.consumed.as_dict()
        state.totals = count_consumed(state.totals, step.collected)
        remember_trained(self.cfg.run_dir, state, [a.content for a in used], [k for a in used for k in a.keys])
        step.record = state.record = step_record(step, state.version, dict(self.model.proof.counts),
                                                 sorted(self.quarantine.samplers))
        await self.lease.held()  # fenced out by another trainer, or not sure it still holds the run: no checkpoint
        await asyncio.to_thread(self.model.save, state)
        self.lease.check()

    async def account(self, step: TrainerStep, settled: tuple[dict[str, int], dict]) -> dict:
        """With the step's groups acked and every message counted (`settled`: only after the step
        that consumed them is checkpointed), the trainer's pace published; the step's finished record."""
        state = self.model.state
        state.totals, accounting = settled
        record = finished_record(step, accounting)
        slots = {s: SlotsEnded(ended=d.ended, undelivered=d.undelivered)
                 for s, d in self.collector.ledger.deliveries.items()}
        step.samples = step_samples(step, self.model.tokenizer, self.cfg.run.samples_per_step)
        status = self.recent.add(record, state.version, dict(self.quarantine.strikes), slots, step.samples)
        await retry_forever("trainer status", lambda: put_trainer_status(self.run, status))
        await retry_forever("run config", lambda: publish_run_config(self.run, self.cfg))  # whatever overwrote it
        return record


async def mark_finished(run: RunClient, step: int) -> None:
    """The run's end, visible outside this process: its own key (samplers' heartbeats read it and
    say it) and the trainer's status marked finished (status shows it)."""
    await retry_forever("mark the run finished", lambda: put_finished(run, step))
    status = await retry_forever("read the trainer status", lambda: read_trainer_status(run))
    if status is not None:
        finished = status.model_copy(update={"finished": True})
        await retry_forever("mark the run finished", lambda: put_trainer_status(run, finished))


async def train_in_thread(model: TrainerModel, batch: Batch, version: int) -> Stepped:
    """A step off the event loop. Cancelled (SIGTERM), it tells the step to stop at the next
    pass: the process then exits in seconds instead of finishing a long step; nothing of the
    step was acked, so its groups are redelivered to the next trainer."""
    model.stop.clear()
    try:
        return await asyncio.to_thread(model.train, batch, version)
    except asyncio.CancelledError:
        model.stop.set()
        raise
