"""`echo-rl status`: what a run is doing, read from the broker alone (any machine that reaches
it can look; a secured broker's observer credentials suffice).

One snapshot (workers/operator/snapshot.py, which the page draws too): the trainer (term, step, version, recent rewards, learner busy, pace,
publish time, what became of every group), each sampler in the registry (state, version and lag
behind the trainer, engine and device, rates, sync time, cost, quarantine), the rollout stream
(messages, bytes, pending, unacked) and which relay each sampler reads weights from. `--once
--json` prints one snapshot for scripts; otherwise a terminal view refreshes every few seconds.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from echo.config import ConfigError
from echo.process.logs import configure_logging, duration
from echo.wire.names import CONTROL_CHARACTERS
from streams.client import RunClient
from streams.credentials import credentials_of
from workers.arguments import run_directory, run_until_signal
from workers.operator.snapshot import REFRESH_S, SLOWEST, snapshot

JOIN_WAIT_S = 24 * 3600.0  # a page served before its run waits this long for the trainer to create it
_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")


def printable(value):
    """`value` with every control character taken out of its strings (keys too): a terminal obeys
    ESC and CSI sequences, and rich passes them through."""
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


SHOWN_ROWS = 20  # samplers listed one a line; a larger fleet is summed up, its slowest listed (--all: every one)


def render(snap: dict, every: bool = False):
    """The snapshot as rich renderables, for a terminal: each sampler a line, or past SHOWN_ROWS
    (and not `every`) the fleet summed up and its slowest listed."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text  # a sampler's own words, shown as written: no markup of theirs is interpreted

    snap = printable(snap)  # bounded at decode already; a terminal is where a slip would cost most
    parts = []
    trainer = snap["trainer"]
    head = Table.grid(padding=(0, 2))
    head.add_row("run", snap["run_id"])
    if trainer is None:
        head.add_row("trainer", "no step yet")
    else:
        head.add_row("progress", progress(trainer))
        head.add_row("trainer", f"term {trainer['term']}, version {trainer['version']}, "
                     f"learner busy {trainer['utilisation']:.0%}, {trainer['step_s']:.2f} s a step, "
                     f"publish {trainer['publish_s']:.2f} s")
        head.add_row("reward (last steps)", " ".join(f"{r:.2f}" for r in trainer["rewards"]))
        accounting, rejected = trainer["accounting"], trainer["rejected"]
        head.add_row("groups", ", ".join(f"{k} {v}" for k, v in accounting.items()) or "-")
        head.add_row("rejected by reason", ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) or "none")
    if snap["stream"]:
        s = snap["stream"]
        head.add_row("rollout stream", f"{s['messages']} messages, {s['bytes'] / 1e6:.1f} MB, "
                     f"{s['pending']} pending, {s['unacked']} unacked")
    storage = snap["storage"]
    head.add_row("account storage", f"{storage['bytes'] / 1e6:.1f} MB " + (
        f"of {storage['limit'] / 1e6:.1f} MB" if storage["limit"] is not None else "(no limit)"))
    fleet, rows = snap["fleet"], snap["samplers"]
    head.add_row("samplers", ", ".join(f"{k} {v}" for k, v in fleet["by_state"].items()) or "none")
    for name, unit in (("groups_per_s", "groups/s, active"), ("lag", "versions behind")):
        if fleet[name] is not None:
            head.add_row(f"  {unit}", "  ".join(f"{q} {v:.3g}" for q, v in fleet[name].items()))
    parts.append(head)
    title = "samplers"
    if len(rows) > SHOWN_ROWS and not every:
        slowest = set(fleet["slowest"])
        rows = sorted((s for s in rows if s["id"] in slowest), key=lambda s: s["groups_per_s"])
        title = f"the {len(rows)} slowest active of {len(snap['samplers'])} samplers (--all: every one)"
    table = Table("sampler", "state", "version", "lag", "engine", "device", "relay", "groups/s", "tokens/s",
                  "sync s", "cost/h", "published", "undelivered", "seen", title=title, title_justify="left")
    for s in rows:
        table.add_row(s["id"], s["state"], str(s["version"]), "-" if s["lag"] is None else str(s["lag"]),
                      Text(engine_cell(s)), Text(s["device"]), Text(s["relay"]), f"{s['groups_per_s']:.2f}",
                      f"{s['tokens_per_s']:.0f}",
                      "-" if s["sync_s"] is None else f"{s['sync_s']:.2f}", f"{s['cost_per_hour']:g}",
                      str(s["groups_published"]), undelivered(s), f"{s['seen_s_ago']:.0f} s ago")
    parts.append(table)
    return Group(*parts)


def engine_cell(s: dict) -> str:
    """A sampler's engine, with the processes its model is split over, and how many times their
    group was lost and why the last time (the page says the same: static/status.html)."""
    if s["ranks"] == 1:
        return s["engine"]
    restarted = f", restarted {s['ranks_restarted']}: {s['rank_lost']}" if s["ranks_restarted"] else ""
    return f"{s['engine']} x{s['ranks']}{restarted}"


def progress(trainer: dict) -> str:
    """Step 7/20 with the time elapsed and left; the last step's age only where it is overdue
    (a trainer in the middle of a 41 s step is not late at 41 s)."""
    of = f"/{trainer['steps']}" if trainer["steps"] else ""
    if trainer["finished"]:
        return f"finished at step {trainer['step']}{of} ({trainer['seen_s_ago']:.0f} s ago)"
    said = f"step {trainer['step']}{of}, elapsed {duration(trainer['elapsed_s'])}"
    said += f", ETA {duration(trainer['eta_s'])}" if trainer["steps"] else ""
    if trainer["overdue"]:
        said += f"; no step for {duration(trainer['seen_s_ago'])}, a step takes about {duration(trainer['pace_s'])}"
    return said


def undelivered(row: dict) -> str:
    """Of a sampler's granted slots ended, those it never delivered (selective delivery shows here)."""
    return f"{row['slots_undelivered']} of {row['slots_ended']}" if row["slots_ended"] else "-"


def _console(out):
    from rich.console import Console

    return Console(file=out, width=None if out.isatty() else 160)  # a pipe or file: one line per sampler


async def watch(run: RunClient, once: bool, as_json: bool, out, every: bool = False) -> None:
    """A live terminal view; or snapshots as JSON lines (one with `once`), or one printed view
    (`every`: each sampler a line, however many)."""
    import orjson

    if not (once or as_json):
        from rich.live import Live

        with Live(render(await snapshot(run), every), console=_console(out), refresh_per_second=1) as live:
            while True:
                await asyncio.sleep(REFRESH_S)
                live.update(render(await snapshot(run), every))
    while True:
        snap = await snapshot(run)
        if as_json:
            out.write(orjson.dumps(snap).decode() + "\n")
            out.flush()
        else:
            _console(out).print(render(snap, every))
        if once:
            return
        await asyncio.sleep(REFRESH_S)


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
    status.add_argument("--all", action="store_true", help=f"each sampler a line, however many (else past "
                        f"{SHOWN_ROWS}: the fleet summed up and its {SLOWEST} slowest)")
    status.add_argument("--json", action="store_true", help="snapshots as JSON lines (one with --once)")
    status.add_argument("--serve", metavar="[HOST:]PORT", help="serve a live page of the run instead (HOST "
                        "defaults to 127.0.0.1: this machine only)")


async def status_command(args, url: str, run_id: str, credentials) -> int:
    from streams.client import PATIENCE_S, open_run

    # A page may be served before the run begins: it waits for the trainer, as a sampler does.
    run = await open_run(url, run_id, "status", credentials=credentials, create=False,
                         join_wait_s=JOIN_WAIT_S if args.serve else 0, give_up_s=PATIENCE_S)
    try:
        if args.serve:
            from workers.operator.page import serve_page

            # On the trainer's machine (--run), the charts begin at the run's first step.
            await serve_page(run, args.serve, args.run)
        else:
            await watch(run, args.once, args.json, sys.stdout, args.all)
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
