"""`echo-rl`: run a local swarm, a single trainer, sampler or relay, or replay a run's rollout stream.

Each command is one module in its wing, its arguments beside the code it calls: workers/trainer/
trainer.py, workers/sampler/sampler_command.py, and the operator's in workers/operator/. What a command
module holds, and how it runs in its process: workers/entry.py."""

from __future__ import annotations

import argparse
from typing import NoReturn

from workers import entry
from workers.operator import (
    evaluate,
    export_env,
    hub,
    plan,
    quarantine,
    relay,
    replay,
    report,
    secure,
    show_config,
    status,
    up,
)
from workers.sampler import ranks, sampler_command
from workers.trainer import trainer_command

# In this order in `echo-rl --help`.
COMMANDS = {command.NAME: command
            for command in (up, hub, trainer_command, sampler_command, ranks, relay, secure, evaluate, report, replay, quarantine,
                            status, plan, show_config, export_env)}


def build_parser() -> argparse.ArgumentParser:
    return entry.build_parser(COMMANDS, __doc__)


def main(argv: list[str] | None = None) -> int:
    return entry.main(COMMANDS, argv, __doc__)


def run(argv: list[str] | None = None) -> NoReturn:
    """The `echo-rl` command (workers/entry.py::run)."""
    entry.run(COMMANDS, argv, __doc__)


if __name__ == "__main__":
    run()
