"""`echo-rl`: run a local swarm, a single trainer, sampler or relay, or replay a run's rollout stream.

Each command is one module in its wing, its arguments beside the code it calls: workers/trainer/
trainer.py, workers/sampler/sampler.py, and the operator's in workers/operator/. Each has:

    NAME                  the command's name on the command line
    register(sub)         adds the command's parser, with its flags and help, to `sub` (argparse subparsers)
    run(args) -> int      does the command; the exit code (a ConfigError is said in one line, exit 2)

and may have:

    NEEDS                 packages of the full install it imports, which an edge sampler's leaves out
    starts_server(args)   whether it starts a nats-server of its own (its binary is checked at start)

Heavy imports (torch, transformers) stay inside `run`: the parser, and a command that does not
need them, load without them. What several commands share: workers/arguments.py."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import re
import sys
from typing import NoReturn

from echo.config import ConfigError
from streams.server import nats_server_binary
from workers.operator import (evaluate, export_env, hub, plan, quarantine, relay, replay, report, secure, show_config,
                              status, up)
from workers.sampler import ranks, sampler
from workers.trainer import trainer

# In this order in `echo-rl --help`.
COMMANDS = {command.NAME: command
            for command in (up, hub, trainer, sampler, ranks, relay, secure, evaluate, report, replay, quarantine,
                            status, plan, show_config, export_env)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.register(sub)
    return parser


def check_full_install(args) -> None:
    """What an edge sampler's install (pip install echo-rl) leaves out, said at start in one line:
    the packages a command NEEDS, and the nats-server of one that starts its own (`up` the swarm's,
    `relay` the site's, `replay` one on a run's store)."""
    command = COMMANDS[args.command]
    missing = [m for m in getattr(command, "NEEDS", ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"echo-rl {args.command} needs {', '.join(missing)}, which an edge sampler's install leaves "
                          "out: pip install 'echo-rl[full]'")
    starts_server = getattr(command, "starts_server", None)
    if starts_server is not None and starts_server(args):
        try:
            nats_server_binary()
        except RuntimeError as e:
            raise ConfigError(str(e)) from None


OVERRIDE = re.compile(r"[A-Za-z_][\w.-]*=")  # section.key=value (or a bare key=value: answered by name)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with overrides anywhere on it, as Hydra takes them: one after an option
    (`config show run.steps=2 --config x.yaml run.seed=1`) is an override too, in its place."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or not all(OVERRIDE.match(extra) for extra in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        check_full_install(args)
        return COMMANDS[args.command].run(args)
    except ConfigError as e:
        print(f"echo-rl: {e}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None) -> NoReturn:
    """The `echo-rl` command: main, then the process exits without the interpreter's teardown,
    which takes 1.5 s in a process holding torch, transformers and a model (most of the time a
    test swarm spends after its last step). Everything main started has ended by its return;
    atexit's functions still run (logging's flush, a server an environment started), and the
    output is flushed."""
    code = main(argv)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
