"""`echo-rl hub`: the hub of a run on several machines, with no config to write: a nats-server
with JetStream (domain `hub`) on a store that survives a restart, a client port for the trainer,
samplers and observers, and a leaf port for site relays. Open (on a trusted network), or secured
with the files `echo-rl secure init DIR` made (TLS and each role's nkey). It prints what the
trainer, a sampler and a relay are given, and runs until stopped (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import structlog

from echo.config import ConfigError
from echo.process.logs import configure_logging
from streams.secure import SERVER_CONF, SecureDir
from streams.server import NatsServer, ServerConfig
from workers.arguments import run_until_signal
from workers.operator.relay import LOOPBACK

log = structlog.get_logger()

NAME = "hub"


def register(sub) -> None:
    hub = sub.add_parser("hub", help="the hub for several machines: nats-server with JetStream and a leaf port, "
                         "open or secured, and what to give the trainer and samplers")
    hub.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    hub.add_argument("--port", type=int, default=4222, help="the client port: trainer, samplers, observers")
    hub.add_argument("--leaf-port", type=int, default=7422, help="the port site relays join (0: none)")
    hub.add_argument("--store", type=Path, default=Path("runs/hub"), help="JetStream's store: keep it across restarts")
    hub.add_argument("--secure", type=Path, metavar="DIR", help="a directory `echo-rl secure init` made: TLS and "
                     "each role's nkey")
    hub.add_argument("--insecure", action="store_true", help="listen beyond this machine without credentials")
    hub.add_argument("--log-json", action="store_true")


def starts_server(args) -> bool:
    return True


def hub_server(args) -> NatsServer:
    """The hub's nats-server, from the command's arguments; a bad choice is a ConfigError."""
    if args.secure is None and not args.insecure and args.host not in LOOPBACK:
        raise ConfigError(f"--host {args.host} opens the hub to other machines: secure it (--secure DIR from "
                          "`echo-rl secure init DIR --run-id ID --host NAME`) or say --insecure (a trusted network)")
    secured = {}
    if args.secure is not None:
        secure = SecureDir(args.secure)
        if not (secure.dir / SERVER_CONF).exists():
            raise ConfigError(f"--secure {args.secure}: no {SERVER_CONF} there; make it with `echo-rl secure init "
                              f"{args.secure} --run-id ID --host NAME`")
        secured = {"include": secure.dir / SERVER_CONF, "leaf_include": secure.leaf_conf}
    return NatsServer(args.store, ServerConfig(port=args.port, host=args.host, leaf_port=args.leaf_port or None,
                                               log_file=args.store.parent / f"{args.store.name}.log", **secured))


def instructions(args, server: NatsServer) -> dict[str, str]:
    """What each other box is given to join: this hub's address as others reach it."""
    name = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    url = f"nats://{name}:{server.port}"  # TLS, where secured, is the server's to ask: the URL is the same
    secure = args.secure.resolve() if args.secure else None
    creds = (lambda user: f" --creds {secure / (user + '.nk')} --tls-ca {secure / 'ca.pem'}") if secure else \
        (lambda user: "")
    said = {
        "url": url,
        "trainer": f"echo-rl trainer --config RUN.toml --nats {url}{creds('trainer')}",
        "sampler": f"echo-rl sampler --nats {url} --run-id RUN_ID --id NAME{creds('sampler-NAME')}",
        "status": f"echo-rl status --nats {url} --run-id RUN_ID{creds('observer')}",
    }
    if server.config.leaf_port:
        said["relay"] = (f"echo-rl relay --hub nats-leaf://{name}:{server.config.leaf_port} --run-id RUN_ID "
                         + (f"--creds {secure}/relay-NAME.nk --tls-ca {secure / 'ca.pem'}" if secure else "--insecure"))
    return said


async def serve(args) -> None:
    server = hub_server(args).start()
    try:
        log.info("hub.ready", store=str(args.store.resolve()), secured=args.secure is not None,
                 **instructions(args, server))
        await asyncio.Event().wait()  # until stopped
    finally:
        server.stop()


def run(args) -> int:
    configure_logging(args.log_json, role="hub", worker="hub")
    return run_until_signal(serve(args))
