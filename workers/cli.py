"""`echo-rl`: run a local swarm, a single trainer, sampler or relay, or replay a run's rollout stream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import re
import signal
import socket
import sys
from pathlib import Path

import orjson
import structlog
from nats.js.errors import KeyNotFoundError
from pydantic import ValidationError

from echo.config import ConfigError, EchoConfig, apply_override, format_errors, load_config, validate_config
from echo.edge import check_config_from_broker, drop_this_box_fields
from echo.logs import bind_process, configure_logging
from echo.protocol import CONFIG_KEY, HUB_DOMAIN, check_id
from echo.tasks import load_task
from streams.client import cancel_until_done
from streams.credentials import credentials_of
from streams.server import nats_server_binary


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config field")
    p.add_argument("--model", help="tiny, smollm2, or a local model folder (model.name)")
    p.add_argument("--mode", choices=["async", "sequential"], help="run.mode")
    p.add_argument("--steps", type=int, help="run.steps")
    p.add_argument("--run-id", help="run.id")
    p.add_argument("--nats", help="NATS server URL (nats.url)")
    p.add_argument("--creds", help="this client's nkey seed file, on a secured broker (nats.creds)")
    p.add_argument("--tls-ca", help="the CA that signed the secured broker's certificate (nats.tls_ca)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines instead of readable ones")


def _span(kind):
    """An argparse type for 'LOW:HIGH'."""

    def parse(text: str):
        low, sep, high = text.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: LOW:HIGH")
        return kind(low), kind(high)

    return parse


def _at_least(low: int):
    """An argparse type for an integer of at least `low`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: at least {low}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="a local swarm: embedded nats-server, one trainer, N samplers")
    _config_args(up)
    up.add_argument("--samplers", type=int, help="sampler.count")
    up.add_argument("--relay", action="store_true", help="put the samplers behind a site relay, as on a remote site")
    up.add_argument("--secure", action="store_true", help="TLS and per-role credentials (echo-rl secure init)")
    up.add_argument("--cluster", type=int, default=0, metavar="N", help="the broker as an N-node JetStream cluster "
                    "(3: survives one node down), every stream on all nodes (nats.replicas = N)")
    up.add_argument("--trainer-ranks", type=int, default=1, metavar="N", help="the trainer as N ranks under "
                    "torchrun on this machine, its model sharded across them (FSDP2)")
    trainer = sub.add_parser("trainer", help="run the trainer of a run (under torchrun: its ranks)")
    _config_args(trainer)
    sampler = sub.add_parser("sampler", help="run one sampler; without --config it reads the run's config from NATS")
    _config_args(sampler)
    sampler.add_argument("--id", required=True, help="this sampler's id (its rollout subject)")
    sampler.add_argument("--task", help="task.name: a task not built in must be named here, never by the broker")
    sampler.add_argument("--weights-from", help="read weights from this relay, everything else from --nats, the hub "
                         "(a secured relay serves weights only) (nats.weights_url)")
    relay = sub.add_parser("relay", help="a site relay: a leaf node of the hub mirroring a run's weights for its samplers")
    relay.add_argument("--hub", required=True, help="the upstream's leaf-node URL, e.g. nats-leaf://hub:7422")
    relay.add_argument("--run-id", required=True, help="the run whose weights to mirror")
    relay.add_argument("--domain", default=f"relay-{_host_token()}", help="this relay's JetStream domain (unique in the tree)")
    relay.add_argument("--upstream-domain", default=HUB_DOMAIN, help="the upstream's domain: the hub's, or a parent relay's")
    relay.add_argument("--host", default="0.0.0.0", help="address samplers connect to")
    relay.add_argument("--port", type=int, default=4222, help="port samplers connect to")
    relay.add_argument("--leaf-port", type=int, help="accept sub-site relays on this port (default: none accepted)")
    relay.add_argument("--store", type=Path, help="JetStream store (default runs/relays/<domain>)")
    relay.add_argument("--creds", type=Path, help="relay-NAME.nk from `echo-rl secure add-relay`, with its "
                       "relay-NAME-cert.pem, -key.pem and -users.conf beside it")
    relay.add_argument("--tls-ca", type=Path, help="the CA that signed the secured hub's certificate")
    relay.add_argument("--insecure", action="store_true", help="listen on a non-loopback --host without credentials")
    relay.add_argument("--log-json", action="store_true")
    secure = sub.add_parser("secure", help="credentials and TLS for a secured broker").add_subparsers(
        dest="secure_command", required=True)
    init = secure.add_parser("init", help="a CA, the server's certificate and config, trainer/observer/sampler nkeys")
    init.add_argument("dir", type=Path)
    init.add_argument("--run-id", required=True, help="the run the credentials are for")
    init.add_argument("--host", action="append", default=[], help="a name or address samplers reach the hub by "
                      "(repeat; localhost and 127.0.0.1 always)")
    init.add_argument("--samplers", default="", help="comma-separated sampler ids to issue now")
    init.add_argument("--relay", action="append", default=[], metavar="NAME=HOST",
                      help="a relay to issue now, and the name its samplers reach it by (repeat)")
    init.add_argument("--exist-ok", action="store_true", help="DIR holds this run's credentials already: keep them "
                      "(compose runs init on every up)")
    add = secure.add_parser("add-sampler", help="a new sampler's credentials; reloads a running hub")
    add.add_argument("dir", type=Path)
    add.add_argument("id")
    add_relay = secure.add_parser("add-relay", help="a relay's leaf credentials and client-port certificate; "
                                  "reloads a running hub")
    add_relay.add_argument("dir", type=Path)
    add_relay.add_argument("name")
    add_relay.add_argument("--host", action="append", default=[], help="a name or address samplers reach the relay "
                           "by (repeat; localhost and 127.0.0.1 always)")
    evaluate = sub.add_parser("eval", help="score the base model and the run's last published weights on held-out prompts")
    evaluate.add_argument("--run", required=True, type=Path, help="run directory")
    evaluate.add_argument("--prompts", type=_at_least(1), default=50, help="held-out prompts to score (greedy)")
    evaluate.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                          help="override the run's config here, e.g. this machine's model.device")
    evaluate.add_argument("--log-json", action="store_true")
    report = sub.add_parser("report", help="plot reward, staleness and learner utilisation to <run>/report.png")
    report.add_argument("--run", required=True, type=Path, help="run directory")
    report.add_argument("--log-json", action="store_true")
    replay = sub.add_parser("replay", help="print a run's rollout stream as JSON lines")
    replay.add_argument("--run", required=True, help="run directory (starts a server on its store) or run id with --nats")
    replay.add_argument("--nats", help="read from this server instead of the run directory's store")
    replay.add_argument("--creds", help="with --nats, on a secured broker: observer (or trainer) credentials")
    replay.add_argument("--tls-ca")
    replay.add_argument("--out", help="write to this file instead of stdout")
    replay.add_argument("--seq", type=_span(int), metavar="FIRST:LAST", help="stream sequences (both included)")
    replay.add_argument("--since", type=float, metavar="UNIX_S", help="groups created at or after this time")
    replay.add_argument("--until", type=float, metavar="UNIX_S", help="groups created at or before this time")
    replay.add_argument("--version", type=int, help="groups generated with this policy version")
    replay.add_argument("--sampler", help="groups published by this sampler")
    replay.add_argument("--task", help="groups of this task")
    replay.add_argument("--reward", type=_span(float), metavar="LOW:HIGH", help="groups whose mean claimed reward "
                        "lies in this range")
    replay.add_argument("--rejected", action="store_true", help="only the messages the trainer would reject, with why")
    replay.add_argument("--table", action="store_true", help="one readable line per record instead of JSON lines")
    replay.add_argument("--retrain", action="store_true", help="train again over exactly the groups each recorded "
                        "step consumed, from the run's config and seed, and compare with its published weights")
    replay.add_argument("--log-json", action="store_true")
    quarantine = sub.add_parser("quarantine", help="samplers the trainer ignores: list them, or lift one's quarantine")
    quarantine.add_argument("action", choices=["list", "lift"])
    quarantine.add_argument("sampler", nargs="?", help="the sampler to lift")
    quarantine.add_argument("--nats", required=True, help="the hub's URL")
    quarantine.add_argument("--run-id", required=True)
    quarantine.add_argument("--creds", help="on a secured broker: the trainer's credentials (only it may write)")
    quarantine.add_argument("--tls-ca")
    status = sub.add_parser("status", help="a live view of a run: trainer, samplers, stream, relays")
    status.add_argument("--run", type=Path, help="a run directory: its config names the broker and the run id")
    status.add_argument("--nats", help="the hub's URL (with --run-id)")
    status.add_argument("--run-id")
    status.add_argument("--creds", help="on a secured broker: observer (or trainer) credentials")
    status.add_argument("--tls-ca")
    status.add_argument("--once", action="store_true", help="one snapshot, then exit")
    status.add_argument("--json", action="store_true", help="snapshots as JSON lines (one with --once)")
    plan = sub.add_parser("plan", help="which samplers to pay for: the capacity model on a fleet file or a live "
                          "run's registry")
    plan.add_argument("--fleet", type=Path, help="a fleet TOML file ([learner] and [[workers]]; README, Scheduling)")
    plan.add_argument("--nats", help="a live run's broker (with --run-id): its samplers' measured rates and costs")
    plan.add_argument("--run-id")
    plan.add_argument("--creds", help="on a secured broker: an observer's or the trainer's credentials")
    plan.add_argument("--tls-ca")
    plan.add_argument("--target", type=float, default=0.9, help="the learner utilisation to reach (0-1]")
    plan.add_argument("--max-staleness", type=_at_least(0), default=4, help="try staleness bounds 0 to N")
    plan.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return parser


def _host_token() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "site"


def relay_config_from_args(args):
    from workers.relay import RelayConfig

    fields = {k: getattr(args, k) for k in ("hub", "run_id", "domain", "upstream_domain", "host", "port", "leaf_port",
                                            "creds", "tls_ca", "insecure")}
    try:
        return RelayConfig(**fields, store_dir=args.store or Path("runs/relays") / args.domain)
    except ValidationError as e:
        raise ConfigError("invalid relay options: " + format_errors(e)) from None


def local_overrides(args) -> list[str]:
    """The command line's config fields as `section.key=value` overrides: `--set` and the shortcut flags."""
    overrides = list(args.set)
    for flag, field in [("model", "model.name"), ("mode", "run.mode"), ("steps", "run.steps"),
                        ("run_id", "run.id"), ("nats", "nats.url"), ("samplers", "sampler.count"),
                        ("task", "task.name"), ("creds", "nats.creds"), ("tls_ca", "nats.tls_ca"),
                        ("weights_from", "nats.weights_url")]:
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{field}={orjson.dumps(value).decode()}")  # a JSON scalar is a TOML value
    return overrides


def config_from_args(args) -> EchoConfig:
    return load_config(args.config, local_overrides(args))


async def sampler_config_from_run(args) -> EchoConfig:
    """An edge sampler needs only the server and run id: the trainer keeps the config in KV."""
    from streams.client import open_run

    if not (args.nats and args.run_id):
        raise ConfigError("a sampler without --config needs --nats and --run-id")
    local = local_overrides(args)
    given: dict = {}
    for assignment in local:
        apply_override(given, assignment)
    nats_given = given.get("nats", {})
    hub_domain = nats_given.get("hub_domain", HUB_DOMAIN)
    credentials = credentials_of(nats_given.get("creds", ""), nats_given.get("tls_ca", ""))
    run = await open_run(args.nats, args.run_id, f"sampler-{args.id}-config", hub_domain or None,
                         credentials=credentials, create=False)
    try:
        while True:
            try:
                entry = await run.state.get(CONFIG_KEY)
                break
            except KeyNotFoundError:  # the trainer has not started yet
                await asyncio.sleep(1.0)
    finally:
        await run.close()
    data = orjson.loads(entry.value)
    check_config_from_broker(data, given)
    drop_this_box_fields(data)
    for assignment in local:  # --nats among them: the hub, or this site's relay
        apply_override(data, assignment)
    return validate_config(data)


def secure_command(args) -> int:
    from streams.secure import SecureDir

    secure = SecureDir(args.dir)
    try:
        if args.secure_command == "init":
            if args.exist_ok and secure.holds_run(args.run_id):
                print(f"{secure.dir} holds run {args.run_id}'s credentials already: kept")
                return 0
            relays = [relay.partition("=") for relay in args.relay]
            if any(not host for _, _, host in relays):
                raise ValueError(f"--relay {args.relay}: give each as NAME=HOST")
            samplers = [s for s in args.samplers.split(",") if s]
            secure.init(args.run_id, ["localhost", "127.0.0.1", *args.host], samplers)
            for name, _, host in relays:
                secure.add_relay(name, [host])
            print(f"wrote {secure.dir}: include {secure.dir / 'server.conf'} in the hub's config "
                  f"(and {secure.leaf_conf} in its leafnodes block, for relays); "
                  f"trainer: --creds {secure.seed_file('trainer')} --tls-ca {secure.ca_file}")
        elif args.secure_command == "add-relay":
            files = secure.add_relay(args.name, args.host)
            print(f"relay {args.name}: copy {files.seed_file.name}, {files.cert_file.name}, {files.key_file.name}, "
                  f"{files.users_file.name} and ca.pem from {secure.dir} to the site, side by side; "
                  f"echo-rl relay --creds {files.seed_file.name} --tls-ca ca.pem ...")
        else:
            creds = secure.add_sampler(args.id)
            print(f"sampler {args.id}: --creds {creds.seed_file} --tls-ca {creds.ca_file}")
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return 0


def status_target(args) -> tuple[str, str]:
    """(broker URL, run id) from a run directory's config, or as given."""
    if args.run:
        cfg = load_config(run_directory(args.run, "config.toml") / "config.toml")
        return cfg.nats.url, cfg.run.id
    if args.nats and args.run_id:
        return args.nats, args.run_id
    raise ConfigError("status: --run RUN_DIR, or --nats URL --run-id ID")


async def status_command(args, url: str, run_id: str) -> int:
    from streams.client import open_run
    from workers.status import watch

    run = await open_run(url, run_id, "status", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=5)
    try:
        await watch(run, args.once, args.json, sys.stdout)
    finally:
        await run.close()
    return 0


async def quarantine_command(args) -> int:
    """Print the quarantined samplers (JSON) after lifting `args.sampler`'s quarantine, if asked."""
    from streams.client import open_run
    from streams.quarantine import change_quarantine, read_quarantine

    if args.action == "lift" and not args.sampler:
        raise ConfigError("quarantine lift: name the sampler to lift")
    run = await open_run(args.nats, args.run_id, "operator", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=5)
    try:
        samplers = await read_quarantine(run)
        if args.action == "lift":
            if args.sampler not in samplers:
                raise ConfigError(f"sampler {args.sampler!r} is not quarantined (quarantined: {sorted(samplers)})")
            samplers = await change_quarantine(run, lambda current: current.pop(args.sampler, None))
    finally:
        await run.close()
    print(orjson.dumps(samplers).decode())
    return 0


async def live_fleet(args):
    """The capacity model's inputs from a live run: the trainer's pace and the registry."""
    from echo.capacity import LearnerPace
    from streams.client import open_run
    from streams.registry import read_learner, read_statuses
    from workers.plan import measured

    run = await open_run(args.nats, args.run_id, "planner", credentials=credentials_of(args.creds, args.tls_ca),
                         create=False, join_wait_s=5)
    try:
        pace, statuses = await read_learner(run), await read_statuses(run)
    finally:
        await run.close()
    if pace is None:
        raise ConfigError(f"run {args.run_id!r}: its trainer has not finished a step yet, so its step time is unknown")
    return LearnerPace(pace.step_s, pace.groups_per_step, pace.max_staleness), measured(statuses)


def plan_command(args) -> int:
    from workers.plan import fleet_from_file, plan_report, print_plan

    if bool(args.fleet) == bool(args.nats and args.run_id):
        raise ConfigError("plan: give --fleet FILE, or --nats URL with --run-id ID")
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target {args.target}: a utilisation above 0, at most 1")
    learner, workers = fleet_from_file(args.fleet) if args.fleet else asyncio.run(live_fleet(args))
    print_plan(plan_report(learner, workers, args.target, args.max_staleness), args.json)
    return 0


def check_hardware(cfg: EchoConfig, sampler: bool) -> None:
    """A device or engine this machine does not have stops the worker at start, in one line."""
    from echo.devices import resolve_device
    from echo.engines import engine_choice

    resolve_device(cfg.model.device)
    if sampler:
        engine_choice(cfg.sampler.engine)


# What an edge sampler's install (pip install echo-rl) leaves out, by the command that needs it.
FULL_INSTALL = {"up": ("cryptography",), "secure": ("cryptography",), "status": ("rich",),
                "report": ("matplotlib",)}


def check_full_install(args) -> None:
    """What an edge sampler's install leaves out, said at start in one line."""
    missing = [m for m in FULL_INSTALL.get(args.command, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"echo-rl {args.command} needs {', '.join(missing)}, which an edge sampler's install leaves "
                          "out: pip install 'echo-rl[full]'")
    # These start a server of their own: `up` the swarm's, `relay` the site's, `replay` one on a run's store.
    if args.command in ("up", "relay") or (args.command == "replay" and not args.nats):
        try:
            nats_server_binary()
        except RuntimeError as e:
            raise ConfigError(str(e)) from None


STOPPING_RECANCEL_S = 3.0  # longer than a worker's own clean-up (a last heartbeat, closing its connection)


def run_directory(path: Path, needs: str) -> Path:
    """`path` if it is a run directory holding `needs`, else a ConfigError saying where runs are."""
    if not (Path(path) / needs).exists():
        raise ConfigError(f"--run {path}: not a run directory (it has no {needs}); a run's directory is "
                          "<run.dir>/<run.id>, e.g. runs/run-20261122-101500")
    return Path(path)


def run_until_signal(coro) -> int:
    """Run a worker's coroutine; SIGTERM or SIGINT cancels it so it can close cleanly (exit 0).
    A failure is logged with its reason and exits 1, for compose or systemd to restart it."""

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
    except Exception as e:
        structlog.get_logger().exception("worker.failed", reason=repr(e))
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_full_install(args)
        if args.command == "eval":
            from workers.evaluate import evaluate_run

            run_dir = run_directory(args.run, "config.toml")  # checked before logging is set up
            configure_logging(args.log_json, run=run_dir.name, role="eval", worker="eval")
            print(orjson.dumps(evaluate_run(run_dir, args.prompts, args.set), option=orjson.OPT_INDENT_2).decode())
            return 0
        if args.command == "report":
            from workers.report import write_report

            run_dir = run_directory(args.run, "metrics.jsonl")
            configure_logging(args.log_json, run=run_dir.name, role="report", worker="report")
            print(write_report(run_dir))
            return 0
        if args.command == "replay":
            from streams.replay import Keep, replay

            run = args.run if args.nats else run_directory(args.run, "nats")
            configure_logging(args.log_json, run=Path(args.run).name, role="replay", worker="replay")
            if args.retrain:
                from workers.retrain import retrain

                report = retrain(run_directory(args.run, "metrics.jsonl"), args.nats, credentials_of(args.creds, args.tls_ca))
                print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
                return 0 if report["identical"] else 1
            keep = Keep(seqs=args.seq, since=args.since, until=args.until, version=args.version, sampler=args.sampler,
                        task=args.task, rewards=args.reward, rejected_only=args.rejected)
            return replay(run, args.nats, args.out, keep, args.table, credentials_of(args.creds, args.tls_ca))
        if args.command == "secure":
            return secure_command(args)
        if args.command == "plan":
            return plan_command(args)
        if args.command == "quarantine":
            return asyncio.run(quarantine_command(args))
        if args.command == "status":
            url, run_id = status_target(args)
            configure_logging(level="warning")  # the view is the output
            return run_until_signal(status_command(args, url, run_id))
        if args.command == "relay":
            cfg = relay_config_from_args(args)
            configure_logging(args.log_json, run=cfg.run_id, role="relay", worker=f"relay-{cfg.domain}")
            from workers.relay import run_relay

            return run_until_signal(run_relay(cfg))
        if args.command == "sampler":
            try:
                check_id("sampler id", args.id)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            # Before reaching the broker; the run id of a --config is known once it is read.
            configure_logging(args.log_json, run=args.run_id, role="sampler", worker=f"sampler-{args.id}")
            if args.config is None:
                cfg = asyncio.run(sampler_config_from_run(args))
            else:
                cfg = config_from_args(args)
            bind_process(run=cfg.run.id)
            check_hardware(cfg, sampler=True)
            from workers.sampler import run_sampler

            return run_until_signal(run_sampler(cfg, args.id))
        cfg = config_from_args(args)
        load_task(cfg.task)  # a bad task name or params fails here, once, not in each worker later
        if args.command == "trainer":
            check_hardware(cfg, sampler=False)
            from workers.trainer_model import Ranks, follow_rank_0

            ranks = Ranks(cfg.model.device)  # rank 0 of 1, unless started by torchrun
            configure_logging(args.log_json, run=cfg.run.id, role="trainer",
                              worker="trainer" if ranks.rank == 0 else f"trainer-rank{ranks.rank}")
            if ranks.rank > 0:
                return follow_rank_0(cfg, ranks)  # no signal handling: torchrun's SIGTERM ends it
            from workers.trainer import run_trainer

            return run_until_signal(run_trainer(cfg, ranks))
        configure_logging(args.log_json, run=cfg.run.id, role="up", worker="up")
        from workers.swarm import up

        return up(cfg, args.log_json, relay=args.relay, secure=args.secure, cluster=args.cluster,
                  trainer_ranks=args.trainer_ranks)
    except ConfigError as e:
        print(f"echo-rl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
