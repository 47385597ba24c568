"""Shared fixtures: a real nats-server per test on a free loopback port with a temp store."""

from __future__ import annotations

import pytest

from echo.config import EchoConfig, validate_config
from streams.server import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    with NatsServer(tmp_path / "jetstream") as server:
        yield server


def tiny_config(tmp_path, **sections) -> EchoConfig:
    """A config for the tiny model with small batches, runs under tmp_path."""
    data = {
        "run": {"id": "test", "dir": str(tmp_path / "runs"), "steps": 5},
        "model": {"name": "tiny"},
        "lora": {"r": 4, "alpha": 8.0},
        "sampling": {"group_size": 4, "max_new_tokens": 8, "prompts_per_call": 2},
        "trainer": {"groups_per_step": 4, "threads": 1},
        "sampler": {"threads": 1},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return validate_config(data)
