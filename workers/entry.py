"""How an `echo-rl` command runs in its process: its line parsed, what it needs checked, run, and
the process ended. The whole command line (workers/cli.py) and a worker forked by a local swarm
(workers/operator/swarm.py, which the command line imports: the child must not import it back)
both run through here, each with its own commands.

A command is a module with:

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
from types import ModuleType
from typing import NoReturn

from echo.config import ConfigError
from streams.server import nats_server_binary
from workers.sampler import sampler_command
from workers.trainer import trainer_command

Commands = dict[str, ModuleType]

WORKERS: Commands = {trainer_command.NAME: trainer_command, sampler_command.NAME: sampler_command}  # what a local swarm forks


def build_parser(commands: Commands, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-rl", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands.values():
        command.register(sub)
    return parser


def check_full_install(command: ModuleType, args) -> None:
    """What an edge sampler's install (pip install echo-rl) leaves out, said at start in one line:
    the packages a command NEEDS, and the nats-server of one that starts its own (`up` the swarm's,
    `relay` the site's, `replay` one on a run's store)."""
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


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with overrides anywhere on it, as Hydra takes them: one after an option
    (`config show run.steps=2 --config x.yaml run.seed=1`) is an override too, in its place."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or not all(OVERRIDE.match(extra) for extra in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    return args


def main(commands: Commands, argv: list[str] | None = None, description: str | None = None) -> int:
    args = parse(build_parser(commands, description), argv)
    try:
        check_full_install(commands[args.command], args)
        return commands[args.command].run(args)
    except ConfigError as e:
        print(f"echo-rl: {e}", file=sys.stderr)
        return 2


def run(commands: Commands, argv: list[str] | None = None, description: str | None = None) -> NoReturn:
    """main, then the process exits without the interpreter's teardown, which takes 1.5 s in a
    process holding torch, transformers and a model (most of the time a test swarm spends after
    its last step). Everything main started has ended by its return; atexit's functions still run
    (logging's flush, a server an environment started), and the output is flushed."""
    code = main(commands, argv, description)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
