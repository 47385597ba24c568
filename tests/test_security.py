"""Attacks on a run by clients of its broker, each on a real nats-server. Every test here was
written to fail against the code before the defence it checks."""

from __future__ import annotations

import asyncio

import pytest

from echo.config import ConfigError
from echo.edge import check_config_from_broker
from echo.protocol import CONFIG_KEY
from streams.client import open_run
from tests.conftest import tiny_config
from workers.cli import main


def _config_naming_a_shell_command(tmp_path, marker):
    cfg = tiny_config(tmp_path, run={"id": "victim"}).model_dump()
    # logging.config.dictConfig calls any "()" factory with the other keys as arguments.
    cfg["task"] = {
        "name": "logging.config:dictConfig",
        "params": {"version": 1, "handlers": {"h": {"()": "os.system", "command": f"touch {marker}"}}},
    }
    return cfg


def test_a_config_from_the_broker_naming_code_is_refused_and_nothing_runs(nats_server, tmp_path, capsys):
    marker = tmp_path / "pwned"

    async def tamper():
        run = await open_run(nats_server.url, "victim", "attacker")
        import orjson

        await run.state.put(CONFIG_KEY, orjson.dumps(_config_naming_a_shell_command(tmp_path, marker)))
        await run.close()

    asyncio.run(tamper())
    code = main(["sampler", "--id", "s1", "--nats", nats_server.url, "--run-id", "victim"])
    assert not marker.exists()
    assert code == 2
    assert "task.name = 'logging.config:dictConfig' comes from the broker" in capsys.readouterr().err


@pytest.mark.parametrize(
    "broker, local, refused",
    [
        ({"task": {"name": "math"}, "model": {"name": "smollm2"}}, {}, None),
        ({"task": {"name": "my_tasks:Mine"}}, {}, "task.name"),
        ({"task": {"name": "my_tasks:Mine"}}, {"task": {"name": "my_tasks:Mine"}}, None),
        ({"model": {"name": "/home/me/model"}}, {}, "model.name"),
        ({"model": {"name": "/home/me/model"}}, {"model": {"name": "/srv/model"}}, None),
        ({"task": {"name": "math", "params": {"dataset": "/etc/passwd"}}}, {}, "task.params.dataset"),
    ],
)
def test_only_built_in_names_are_taken_from_the_broker(broker, local, refused):
    if refused is None:
        check_config_from_broker(broker, local)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_config_from_broker(broker, local)
