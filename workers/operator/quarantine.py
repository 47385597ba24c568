"""`echo-rl quarantine`: the samplers the trainer ignores, listed, or one's quarantine lifted."""

from __future__ import annotations

import asyncio

import orjson

from echo.config import ConfigError
from echo.process.logs import configure_logging
from streams.credentials import credentials_of

NAME = "quarantine"


def register(sub) -> None:
    quarantine = sub.add_parser("quarantine", help="samplers the trainer ignores: list them, or lift one's quarantine")
    quarantine.add_argument("action", choices=["list", "lift"])
    quarantine.add_argument("sampler", nargs="?", help="the sampler to lift")
    quarantine.add_argument("--nats", required=True, help="the hub's URL")
    quarantine.add_argument("--run-id", required=True)
    quarantine.add_argument("--creds", help="on a secured broker: the trainer's credentials (only it may write)")
    quarantine.add_argument("--tls-ca")


async def quarantine_command(args) -> int:
    """Print the quarantined samplers (JSON) after lifting `args.sampler`'s quarantine, if asked."""
    from streams.client import PATIENCE_S, open_run
    from streams.quarantine import change_quarantine, forgive, read_quarantine

    if args.action == "lift" and not args.sampler:
        raise ConfigError("quarantine lift: name the sampler to lift")
    run = await open_run(args.nats, args.run_id, "operator", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=0, give_up_s=PATIENCE_S)
    try:
        samplers = await read_quarantine(run)
        if args.action == "lift":
            if args.sampler not in samplers:
                raise ConfigError(f"sampler {args.sampler!r} is not quarantined (quarantined: {sorted(samplers)})")
            await forgive(run, args.sampler)  # before the lift: the trainer reads no stale strikes at a restart
            samplers = await change_quarantine(run, lambda current: current.pop(args.sampler, None))
    finally:
        await run.close()
    print(orjson.dumps(samplers).decode())
    return 0


def run(args) -> int:
    configure_logging(level="error")  # its answer is the output; a failure is said in one line
    return asyncio.run(quarantine_command(args))
