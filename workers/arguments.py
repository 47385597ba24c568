"""What several `echo-rl` commands share: the config flags and their overrides, argparse types,
run directories, the hardware check at start, and running a worker until a signal stops it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import orjson
import structlog

from echo.config import ConfigError, EchoConfig, load_config
from echo.tasks import load_task
from streams.client import cancel_until_done


def config_args(p: argparse.ArgumentParser, run_options: bool = True) -> None:
    """The config's file, overrides and shortcuts; `run_options` (the run's mode and steps): not
    for a sampler, which follows the run the trainer runs."""
    p.add_argument("--config", help="the config file: TOML, or YAML (.yaml, .yml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config field")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="overrides, as --set (Hydra's way)")
    p.add_argument("--model", help="tiny, smollm2, a local model folder, or a Hugging Face id owner/name[@revision] "
                   "(model.name)")
    p.add_argument("--run-id", help="run.id")
    p.add_argument("--nats", help="NATS server URL (nats.url)")
    p.add_argument("--creds", help="this client's nkey seed file, on a secured broker (nats.creds)")
    p.add_argument("--tls-ca", help="the CA that signed the secured broker's certificate (nats.tls_ca)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines instead of readable ones")
    if run_options:
        p.add_argument("--mode", choices=["async", "sequential"], help="run.mode")
        p.add_argument("--steps", type=int, help="run.steps")


def span(kind):
    """An argparse type for 'LOW:HIGH'."""

    def parse(text: str):
        low, sep, high = text.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: LOW:HIGH")
        return kind(low), kind(high)

    return parse


def at_least(low: int):
    """An argparse type for an integer of at least `low`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: at least {low}")
        return value

    return parse


def local_overrides(args) -> list[str]:
    """The command line's config fields as `section.key=value` overrides: `--set` and the shortcut flags."""
    overrides = [*args.set, *getattr(args, "overrides", [])]
    set_fields = {assignment.partition("=")[0].strip(): assignment for assignment in overrides}
    for flag, field in [("model", "model.name"), ("mode", "run.mode"), ("steps", "run.steps"),
                        ("run_id", "run.id"), ("nats", "nats.url"), ("samplers", "sampler.count"),
                        ("task", "task.name"), ("creds", "nats.creds"), ("tls_ca", "nats.tls_ca"),
                        ("weights_from", "nats.weights_url")]:
        value = getattr(args, flag, None)
        if value is not None:
            if field in set_fields:  # which one was meant? Neither silently.
                raise ConfigError(f"--{flag.replace('_', '-')} {value} and --set {set_fields[field]} both set {field}: "
                                  "give one")
            overrides.append(f"{field}={orjson.dumps(value).decode()}")  # a JSON scalar is a TOML value
    return overrides


def config_from_args(args) -> EchoConfig:
    return load_config(args.config, local_overrides(args))


def config_and_task_from_args(args) -> EchoConfig:
    """config_from_args, its task loaded: a bad task name or params fails here, once, not in each
    worker later."""
    cfg = config_from_args(args)
    load_task(cfg.task)
    return cfg


def run_directory(path: Path, needs: str) -> Path:
    """`path` if it is a run directory holding `needs`, else a ConfigError saying where runs are."""
    if not (Path(path) / needs).exists():
        raise ConfigError(f"--run {path}: not a run directory (it has no {needs}); a run's directory is "
                          "<run.dir>/<run.id>, e.g. runs/run-20261122-101500")
    return Path(path)


def check_hardware(cfg: EchoConfig, sampler: bool) -> None:
    """A device or engine this machine does not have stops the worker at start, in one line."""
    from echo.engines import engine_choice
    from echo.model.devices import resolve_device

    resolve_device(cfg.model.device)
    if sampler:
        engine_choice(cfg.sampler.engine)


STOPPING_RECANCEL_S = 3.0  # longer than a worker's own clean-up (a last heartbeat, closing its connection)


def run_until_signal(coro) -> int:
    """Run a worker's coroutine; SIGTERM or SIGINT cancels it so it can close cleanly (exit 0).
    A failure is logged with its reason and exits 1, for compose or systemd to restart it; a
    ConfigError is raised for the CLI to say (restarting would not mend it)."""

    async def main():
        task = asyncio.ensure_future(coro)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        signalled = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({task, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        await cancel_until_done([task], STOPPING_RECANCEL_S)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return 0

    try:
        return asyncio.run(main())
    except ConfigError:
        raise  # a wrong setting (URL, credentials, run id): one line from the CLI, exit 2
    except Exception as e:
        structlog.get_logger().exception("worker.failed", reason=repr(e))
        return 1
