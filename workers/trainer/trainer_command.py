"""`echo-rl trainer`: the trainer of a run (under torchrun: each of its ranks)."""

from __future__ import annotations

import os
import time

import structlog

from echo.process.logs import bind_process, configure_logging
from workers.arguments import check_hardware, config_and_task_from_args, config_args, run_until_signal
from workers.trainer.trackers import check_trackers

NAME = "trainer"
log = structlog.get_logger()


def register(sub) -> None:
    trainer = sub.add_parser("trainer", help="run the trainer of a run (under torchrun: its ranks)")
    config_args(trainer)


def run(args) -> int:
    rank = int(os.environ.get("RANK", "0"))  # torchrun's (workers/trainer/model.py's Ranks joins them)
    configure_logging(args.log_json, run=args.run_id, role="trainer",
                      worker="trainer" if rank == 0 else f"trainer-rank{rank}")
    started = time.perf_counter()
    cfg = config_and_task_from_args(args)
    bind_process(run=cfg.run.id)
    check_hardware(cfg, sampler=False)
    check_trackers(cfg.run.trackers)
    # Said before the imports that take a slow machine's first half minute, not after
    log.info("trainer.starting", model=cfg.model.name, task=cfg.task.name, next="torch, transformers and the model")
    from echo.model.loading import pin_model
    from workers.trainer.model import Ranks, follow_rank_0

    cfg.model.name = pin_model(cfg.model.name)  # before the run's config is written: samplers load this revision

    ranks = Ranks(cfg.model.device)  # rank 0 of 1, unless started by torchrun
    log.info("trainer.imported", seconds=round(time.perf_counter() - started, 1), ranks=ranks.world)
    if ranks.rank > 0:
        return follow_rank_0(cfg, ranks)  # no signal handling: torchrun's SIGTERM ends it
    from workers.trainer.trainer import run_trainer

    return run_until_signal(run_trainer(cfg, ranks))
