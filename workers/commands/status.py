"""`echo-rl status`: a live view of a run (workers/status.py): trainer, samplers, stream, relays."""

from __future__ import annotations

import sys
from pathlib import Path

from echo.config import ConfigError
from echo.logs import configure_logging
from streams.credentials import credentials_of
from workers.commands.common import run_directory, run_until_signal

NAME = "status"
NEEDS = ("rich",)


def register(sub) -> None:
    status = sub.add_parser("status", help="a live view of a run: trainer, samplers, stream, relays")
    status.add_argument("--run", type=Path, help="a run directory: its config names the broker and the run id")
    status.add_argument("--nats", help="the hub's URL (with --run-id)")
    status.add_argument("--run-id")
    status.add_argument("--creds", help="on a secured broker: observer (or trainer) credentials")
    status.add_argument("--tls-ca")
    status.add_argument("--once", action="store_true", help="one snapshot, then exit")
    status.add_argument("--json", action="store_true", help="snapshots as JSON lines (one with --once)")
    status.add_argument("--serve", metavar="[HOST:]PORT", help="serve a live page of the run instead (HOST "
                        "defaults to 127.0.0.1: this machine only)")


async def status_command(args, url: str, run_id: str, credentials) -> int:
    from streams.client import PATIENCE_S, open_run
    from workers.status import watch

    run = await open_run(url, run_id, "status", credentials=credentials, create=False, join_wait_s=0,
                         give_up_s=PATIENCE_S)
    try:
        if args.serve:
            from workers.status_page import serve_page

            await serve_page(run, args.serve)
        else:
            await watch(run, args.once, args.json, sys.stdout)
    finally:
        await run.close()
    return 0


def run(args) -> int:
    from streams.replay import run_broker

    if not (args.run or (args.nats and args.run_id)):
        raise ConfigError("status: --run RUN_DIR, or --nats URL --run-id ID")
    configure_logging(level="error")  # the view is the output; a failure is said in one line
    run = run_directory(args.run, "config.toml") if args.run else args.run_id
    # A run directory: where its config says, with its credentials; a finished `up` run from its store.
    with run_broker(run, None if args.run else args.nats, credentials_of(args.creds, args.tls_ca)) as (url, run_id, creds):
        return run_until_signal(status_command(args, url, run_id, creds))
