"""`echo-rl relay`: a site relay, a leaf node of the hub mirroring a run's weights for its samplers."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from pydantic import ValidationError

from echo.config import ConfigError, format_errors
from echo.logs import configure_logging
from echo.protocol import HUB_DOMAIN
from workers.commands.common import run_until_signal

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
    from workers.relay import RelayConfig

    fields = {k: getattr(args, k) for k in ("hub", "run_id", "domain", "upstream_domain", "host", "port", "leaf_port",
                                            "creds", "tls_ca", "insecure")}
    try:
        return RelayConfig(**fields, store_dir=args.store or Path("runs/relays") / args.domain)
    except ValidationError as e:
        raise ConfigError("invalid relay options: " + format_errors(e)) from None


def starts_server(args) -> bool:
    return True  # the site's


def run(args) -> int:
    cfg = relay_config_from_args(args)
    configure_logging(args.log_json, run=cfg.run_id, role="relay", worker=f"relay-{cfg.domain}")
    from workers.relay import run_relay

    return run_until_signal(run_relay(cfg))
