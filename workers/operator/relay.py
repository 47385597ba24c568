"""The relay process: `echo-rl relay --hub nats-leaf://HUB:7422 --run-id RUN`.

An embedded nats-server that is a leaf node of the hub (or of another relay: relays chain into
a tree), with a JetStream domain of its own, mirroring the run's weights. The samplers of a
site connect to it (`echo-rl sampler --nats nats://RELAY:4222 ...`): they read weights from the
mirror and reach the hub's streams through the leaf connection, so each version crosses the
site's uplink once, whatever the number of samplers behind it.

Secured (`--creds relay-NAME.nk --tls-ca ca.pem` from `echo-rl secure add-relay`), its leaf
connection may mirror the weights and nothing else, so its samplers reach the hub for the rest
and read only weights here (`--nats HUB --weights-from RELAY`)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.config import ConfigError, format_errors
from echo.process.logs import configure_logging
from echo.wire.names import HUB_DOMAIN, ID_PATTERN, RunNames
from streams.client import connect
from streams.relay import open_mirrors, prune_replaced
from streams.secure import RelayFiles
from streams.server import NatsServer, ServerConfig
from workers.arguments import run_until_signal

log = structlog.get_logger()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RelayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hub: str  # the upstream's leaf-node URL: nats-leaf://host:7422
    run_id: str = Field(pattern=ID_PATTERN)
    domain: str = Field(pattern=ID_PATTERN)  # this relay's JetStream domain: unique in the tree
    upstream_domain: str = Field(HUB_DOMAIN, pattern=ID_PATTERN)  # the hub's, or the parent relay's
    host: str = "0.0.0.0"  # samplers of the site connect here
    port: int = Field(4222, ge=1, le=65535)
    leaf_port: int | None = Field(None, ge=1, le=65535)  # accept sub-site relays here
    store_dir: Path
    creds: Path | None = None  # relay-NAME.nk from `echo-rl secure add-relay`, its other files beside it
    tls_ca: Path | None = None
    insecure: bool = False  # listen beyond this machine without credentials, knowingly

    @model_validator(mode="after")
    def _secured_where_a_port_leaves_the_machine(self):
        if (self.creds is None) != (self.tls_ca is None):
            raise ValueError("--creds and --tls-ca go together (a secured hub speaks TLS only)")
        if self.creds and self.leaf_port:
            raise ValueError("--leaf-port: a secured relay accepts no sub-site relays yet")
        if self.creds is None and not self.insecure and self.host not in LOOPBACK:
            raise ValueError(f"--host {self.host} opens this relay to other machines: give it credentials (--creds "
                             "relay-NAME.nk --tls-ca ca.pem from `echo-rl secure add-relay`) or say --insecure")
        return self

    def relay_files(self) -> RelayFiles | None:
        return RelayFiles(self.creds, self.tls_ca) if self.creds else None


def loopback_relay_args(
    hub_leaf_url: str, run_id: str, port: int, store_dir: Path, domain: str = "site",
    upstream_domain: str = HUB_DOMAIN, leaf_port: int | None = None,
) -> list[str]:
    """`echo-rl relay` arguments for a relay on this machine's loopback (`up --relay`, tests, benches)."""
    args = ["relay", "--hub", hub_leaf_url, "--run-id", run_id, "--domain", domain, "--upstream-domain", upstream_domain,
            "--host", "127.0.0.1", "--port", str(port), "--store", str(store_dir)]
    return args + (["--leaf-port", str(leaf_port)] if leaf_port else [])


def _relay_server(cfg: RelayConfig) -> NatsServer:
    """The relay's nats-server; secured, it signs its leaf connection with its nkey, checks the
    hub's certificate, and serves its samplers over TLS to their own nkeys only."""
    files = cfg.relay_files()
    secured = {}
    if files:
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        include = cfg.store_dir / "secure.conf"
        include.write_text(files.server_conf())
        secured = {"include": include, "hub_leaf_options": files.leaf_remote()}
    return NatsServer(
        cfg.store_dir, ServerConfig(port=cfg.port, domain=cfg.domain, hub_leaf_url=cfg.hub, leaf_port=cfg.leaf_port,
        host=cfg.host, log_file=cfg.store_dir.parent / f"{cfg.store_dir.name}.log", **secured),
    )


async def run_relay(cfg: RelayConfig) -> None:
    server = _relay_server(cfg).start()
    files = cfg.relay_files()
    nc = None
    try:
        nc = await connect(server.url, f"relay-{cfg.domain}", files)
        names = RunNames(cfg.run_id)
        js = await open_mirrors(nc, names, cfg.upstream_domain)
        log.info("relay.ready", url=f"nats://{cfg.host}:{cfg.port}", run=cfg.run_id, hub=cfg.hub, domain=cfg.domain)
        await prune_replaced(js, names)
    finally:
        if nc is not None:
            await nc.close()
        server.stop()


NAME = "relay"


def _host_token() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "site"


def register(sub) -> None:
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


def relay_config_from_args(args):

    fields = {k: getattr(args, k) for k in ("hub", "run_id", "domain", "upstream_domain", "host", "port", "leaf_port",
                                            "creds", "tls_ca", "insecure")}
    try:
        return RelayConfig(**fields, store_dir=args.store or Path("runs/relays") / args.domain)
    except ValidationError as e:
        raise ConfigError("invalid relay options: " + format_errors(e, model=RelayConfig)) from None


def starts_server(args) -> bool:
    return True  # the site's


def run(args) -> int:
    cfg = relay_config_from_args(args)
    configure_logging(args.log_json, run=cfg.run_id, role="relay", worker=f"relay-{cfg.domain}")

    return run_until_signal(run_relay(cfg))
