"""`echo-rl trainer`: the trainer of a run (under torchrun: each of its ranks)."""

from __future__ import annotations

from echo.logs import configure_logging
from workers.arguments import check_hardware, config_and_task_from_args, config_args, run_until_signal
from workers.trainer.trackers import check_trackers

NAME = "trainer"


def register(sub) -> None:
    trainer = sub.add_parser("trainer", help="run the trainer of a run (under torchrun: its ranks)")
    config_args(trainer)


def run(args) -> int:
    cfg = config_and_task_from_args(args)
    check_hardware(cfg, sampler=False)
    check_trackers(cfg.run.trackers)
    from echo.models import pin_model
    from workers.trainer.model import Ranks, follow_rank_0

    cfg.model.name = pin_model(cfg.model.name)  # before the run's config is written: samplers load this revision

    ranks = Ranks(cfg.model.device)  # rank 0 of 1, unless started by torchrun
    configure_logging(args.log_json, run=cfg.run.id, role="trainer",
                      worker="trainer" if ranks.rank == 0 else f"trainer-rank{ranks.rank}")
    if ranks.rank > 0:
        return follow_rank_0(cfg, ranks)  # no signal handling: torchrun's SIGTERM ends it
    from workers.trainer.loop import run_trainer

    return run_until_signal(run_trainer(cfg, ranks))
