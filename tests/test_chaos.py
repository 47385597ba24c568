"""Chaos on a live tiny swarm (trainer and samplers as OS processes, a real nats-server): each
fault must leave a run that finishes by itself, with every rollout message accounted for
(`published = trained + dropped_stale + rejected + pending`)."""

import asyncio
import signal
import time

import orjson
import pytest
from nats.js.errors import NotFoundError

from echo.protocol import GrantRequest, SamplerStatus, WeightsAnnouncement, decode
from streams.client import open_run
from streams.grants import request_grant
from streams.lease import current_epoch
from streams.registry import put_status
from tests.conftest import read_metrics, tiny_config, wait_for_steps, worker_process

pytestmark = pytest.mark.slow


def _balanced(metrics: list[dict]) -> None:
    for m in metrics:
        a = m["accounting"]
        assert a["published"] == a["trained"] + a["dropped_stale"] + a["rejected"] + a["pending"], m


async def _take_leases_and_die(url: str, run_id: str, sampler_id: str) -> list[int]:
    """A sampler that asks for work with the trainer's current weights, gets leases, beats once
    and is never heard of again (kill -9 in the middle of generating them)."""
    run = await open_run(url, run_id, "ghost", create=False)
    try:
        async with asyncio.timeout(30):
            while True:
                await asyncio.sleep(0.05)
                try:
                    last = await run.js.get_last_msg(run.names.control_stream, run.names.weights_subject)
                except NotFoundError:  # the trainer has not published its first version yet
                    continue
                version = decode(WeightsAnnouncement, last.data).version
                request = GrantRequest(want=2, epoch=await current_epoch(run), version=version)
                grant = await request_grant(run, sampler_id, request)
                if grant.leases:
                    await put_status(run, SamplerStatus(sampler_id=sampler_id, version=version, groups_published=0,
                                                        weight_failures={}, updated_at=time.time()))
                    return grant.leases
    finally:
        await run.close()


def test_a_sampler_that_dies_holding_leases_costs_its_leases_only_until_its_heartbeat_expires(nats_server, tmp_path):
    """The issue's case: on-policy (S=0), two samplers, one dies holding its share of the
    window. Before, the run stopped until trainer.reissue_after_s (300 s); now its leases, and
    only those, are handed out again once its heartbeat is silent for sampler_dead_after_s, and
    no group arrives stale afterwards."""
    cfg = tiny_config(tmp_path, run={"id": "ghost", "steps": 10},
                      trainer={"max_staleness": 0, "sampler_dead_after_s": 1.5, "min_samplers": 2},
                      sampler={"heartbeat_s": 0.2}, nats={"url": nats_server.url})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer = worker_process(config_path, "trainer")
    sampler = worker_process(config_path, "sampler", "--id", "s1")
    try:
        leases = asyncio.run(_take_leases_and_die(nats_server.url, "ghost", "ghost"))
        _, logs = trainer.communicate(timeout=120)
    finally:
        for p in (trainer, sampler):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        sampler.wait(timeout=30)
    assert trainer.returncode == 0, logs[-3000:]
    events = [orjson.loads(line) for line in logs.splitlines() if line.startswith("{")]
    released = [e for e in events if e["event"] == "orders.leases_released"]
    assert [(e["sampler"], e["leases"]) for e in released] == [("ghost", len(leases))]
    assert 1.5 <= released[0]["silent_s"] < 5  # released once silent for sampler_dead_after_s, not 300 s
    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert sum(m["dropped_stale"] for m in metrics) == 0  # lost leases did not over-admit
    _balanced(metrics)
    assert {sampler for m in metrics for _, _, sampler in m["groups"]} == {"s1"}
