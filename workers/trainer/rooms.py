"""The trainer's rooms, opened once from the run's config and checkpoint before its first step:
the rollout inbox and what it consumed, the grant ledger, the quarantine, the judge with what the
run already trained, the granter and its holders, the scheduler (workers/trainer/__init__.py says
what each room owns). The steps themselves are workers/trainer/trainer.py's."""

from __future__ import annotations

from functools import partial

import structlog

from echo.config import EchoConfig
from echo.fleet.consumed import ConsumedSeqs
from echo.fleet.grants import DeliveryBound, GrantLedger
from echo.model.loading import encode_chat
from echo.tasks import load_task
from echo.tasks.dataset import Dataset, check_prompt_lengths
from echo.train.checkpoint import load_trained_completions, load_trained_content
from echo.trust.scorer import Scorer
from streams.client import RunClient
from streams.inbox import RolloutInbox
from streams.lease import Lease
from streams.prompts import publish_prompts
from streams.run_config import publish_run_config
from workers.background import Background
from workers.trainer.accounting import (
    RecentSteps,
    count_abandoned,
    restore_metrics,
    run_task,
)
from workers.trainer.coordinator import Coordinator
from workers.trainer.granter import AsyncGranter, Granter, granter_for
from workers.trainer.intake import Collector
from workers.trainer.judge import AlreadyTrained, Judge, Timeline
from workers.trainer.model import TrainerModel
from workers.trainer.scoring import ScoringProcess
from workers.trainer.strikes import Quarantined

log = structlog.get_logger()


async def share_dataset(run: RunClient, cfg: EchoConfig, task: Dataset, model: TrainerModel) -> None:
    """A dataset's prompts checked against the model's context, then published for samplers: the
    run's config names their manifest's digest."""
    manifest, path = task.manifest, task.p.path  # a verifiers environment's: its rows, written to the cache
    check_prompt_lengths(manifest, partial(encode_chat, model.tokenizer), model.context, cfg.sampling.max_new_tokens,
                         path)
    log.info("dataset.read", path=path, rows=manifest["rows"], skipped=manifest["skipped"], columns=manifest["columns"])
    cfg.task.params["prompts"] = await publish_prompts(run, *task.published_prompts())


async def open_rooms(cfg: EchoConfig, run: RunClient, lease: Lease, background: Background, model: TrainerModel,
                     scoring: ScoringProcess) -> tuple[Collector, Granter, RecentSteps]:
    """The rooms a step passes through, opened once from the run's config and checkpoint: the
    intake (inbox, ledger, quarantine, judge), the granter and its holders, the scheduler, and
    what the step's pace is counted in; the background tasks they need started."""
    run_dir, state = cfg.run_dir, model.state
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.task)
    if hasattr(task, "published_prompts"):  # a dataset on this box: samplers read its prompts from the broker
        await share_dataset(run, cfg, task, model)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    await publish_run_config(run, cfg)
    restore_metrics(run_dir, state)
    inbox = await RolloutInbox.open(run, cfg.trainer.ack_wait_s)
    consumed = ConsumedSeqs(**state.consumed)
    state.totals = await count_abandoned(inbox, consumed, state.totals)
    ledger = GrantLedger(rate_window_s=cfg.sampler.rate_window_s, seed=cfg.run.seed,
                         bound=DeliveryBound(cfg.trainer.undelivered_window, cfg.trainer.undelivered_share),
                         max_tokens=cfg.sampling.max_new_tokens)
    quarantine = Quarantined(run, cfg.trainer.quarantine_after)
    await quarantine.start(background)
    model.proof.suspects.update(quarantine.suspects)  # a predecessor's suspects stay checked
    scorer = Scorer(task, model.tokenizer, model.vocab_size, cfg.sampling, model.routing)
    judge = Judge(scorer, Timeline(cfg.staleness_bound, lease.term, state.version, cfg.begun_within),
                  AlreadyTrained(load_trained_content(run_dir, state.trained_content),
                          load_trained_completions(run_dir, state.trained_completions)),
                  model.proof, model.check_many, scoring)
    background.start(inbox.keep_alive(cfg.trainer.ack_wait_s / 3))
    granter = granter_for(run, lease.term, cfg, state, ledger, quarantine)
    background.start(granter.holders.watch_heartbeats())
    if isinstance(granter, AsyncGranter):
        background.start(granter.redraw_forever())
    recent = RecentSteps(cfg.trainer.groups_per_step, cfg.staleness_bound, cfg.run.steps, cfg.model.name,
                         run_task(cfg))
    if cfg.scheduler.enabled:  # what it chooses, the grants obey
        background.start(Coordinator(run, cfg, granter.standby, recent, ledger).run_forever())
    set_aside = cfg.algorithm.dynamic_sampling_max if cfg.algorithm.dynamic_sampling else 0
    return Collector(inbox, judge, ledger, consumed, quarantine, set_aside), granter, recent
