"""The run's registry of samplers (streams/registry.py): a live sampler's heartbeat says what it
runs and on what, how fast it generates, how long it took to sync each version and what it
costs; a dead sampler's entry expires by itself."""

import asyncio
import os
import signal
import time

import orjson
import pytest

from streams.client import open_run
from streams.registry import read_statuses
from tests.conftest import eventually, running, tiny_config, wait_for_steps, worker_process
from workers.cli import main
from workers.operator.swarm import stop_processes

pytestmark = pytest.mark.slow


def _statuses(url: str, run_id: str):
    async def read():
        run = await open_run(url, run_id, "observer", create=False)
        try:
            return await read_statuses(run)
        finally:
            await run.close()

    return asyncio.run(read())


def test_a_samplers_entry_shows_hardware_rates_syncs_and_cost_and_expires_when_it_dies(nats_server, tmp_path, capsys):
    cfg = tiny_config(tmp_path, run={"id": "registry", "steps": 50}, nats={"url": nats_server.url},
                      sampler={"heartbeat_s": 0.5, "entry_ttl_s": 2, "cost_per_hour": 0.7, "throttle_s": 0.1})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer = worker_process(config_path, "trainer")
    sampler = worker_process(config_path, "sampler", "--id", "s1")
    try:
        wait_for_steps(cfg.run_dir, 3, [trainer, sampler])

        def beat_after_a_third_version():
            status = _statuses(nats_server.url, "registry")[0]
            return status if len(status.sync_s) >= 3 else running(sampler)

        status = eventually(beat_after_a_third_version, 60, why=lambda _: _statuses(nats_server.url, "registry"))
        assert (status.sampler_id, status.state, status.engine, status.device, status.model, status.relay) == (
            "s1", "active", "hf", "cpu", "tiny", "")
        assert status.cost_per_hour == 0.7 and status.ttl_s == 2
        # Calls of 2 groups (sampling.prompts_per_call), each group paused 0.1 s: at least 0.2 s a
        # call, so at most 10 groups a second while generating.
        assert status.call_s >= 0.2 and 0 < status.groups_per_s <= 10 and status.tokens_per_s > 0
        assert len(status.sync_s) >= 3 and all(0 < s < 10 for s in status.sync_s.values()), status.sync_s

        # `echo-rl plan` on the live run: the trainer's measured pace and this sampler's rates.
        assert main(["plan", "--nats", nats_server.url, "--run-id", "registry", "--json"]) == 0
        report = orjson.loads(capsys.readouterr().out)
        assert report["learner"]["groups_per_step"] == 4 and report["learner"]["step_s"] > 0
        [sampler_plan] = report["plan"]["samplers"]
        assert sampler_plan["id"] == "s1" and sampler_plan["cost_per_hour"] == 0.7 and sampler_plan["groups_per_s"] > 0

        os.kill(sampler.pid, signal.SIGKILL)
        last_beat = _statuses(nats_server.url, "registry")[0].updated_at  # the TTL runs from the last put
        # A hang guard: the broker removes it 2 s after the last beat.
        eventually(lambda: not _statuses(nats_server.url, "registry"), 60,
                   why=lambda _: "the dead sampler's entry never expired")
        assert time.time() - last_beat > 1.0  # it went by its TTL, not at once
    finally:
        stop_processes([trainer, sampler], timeout=60)
