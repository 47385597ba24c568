"""Relays: a hub and `echo-rl relay` leaf nodes (separate nats-server processes on loopback),
with real samplers behind them reading weights from the relay's mirror."""

import asyncio

import pytest

from echo.engines.hf import HFEngine
from echo.tasks import load_task
from echo.wire.messages import Grant, GrantRequest, SamplerStatus
from echo.wire.names import CONFIG_KEY, HDR_SAMPLER_ID, RunNames
from streams.client import connect
from streams.grants import request_grant, serve_grants
from streams.lease import take_lease
from streams.registry import put_status, read_statuses, weights_relay
from streams.relay import open_mirrors
from streams.replay import read_rollouts
from streams.server import NatsServer, ServerConfig, free_port
from streams.weights import WeightsPublisher
from tests.conftest import TINY_BASE, adapter_for_version, eventually_async, relay, tiny_config
from workers.cli import build_parser
from workers.sampler.sampler import Sampler
from workers.sampler.sampler_command import sampler_config_from_run


@pytest.fixture
def hub(tmp_path):
    with NatsServer(tmp_path / "hub", ServerConfig(leaf_port=free_port())) as server:
        yield server


@pytest.fixture
def site(hub, tmp_path):
    """A site's nats-server with its own JetStream domain, a leaf node of the hub: what a relay
    runs, without the relay's process."""
    with NatsServer(tmp_path / "site", ServerConfig(domain="site", hub_leaf_url=hub.leaf_url)) as server:
        yield server


async def _mirrored_chunk_sets(hub_run, relay_run) -> tuple[set, set]:
    """The chunk subjects the hub's bucket and the relay's mirror hold."""
    chunks = f"$O.{hub_run.names.weights_bucket}.C.>"
    sets = []
    for js in (hub_run.js, relay_run.local_js):
        info = await js.stream_info(hub_run.names.weights_stream, subjects_filter=chunks)
        sets.append(set(info.state.subjects or {}))
    return sets[0], sets[1]


async def test_two_samplers_behind_a_relay_follow_weights_across_a_relay_restart(hub, runs, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [adapter_for_version(trainer_side, v) for v in range(7)]

    with relay(tmp_path, hub.leaf_url, cfg.run.id, "site") as site:
        run = await runs.open(cfg.run.id, "trainer", url=hub.url)
        weights = WeightsPublisher(await take_lease(run))
        await weights.publish(0, adapters[0], TINY_BASE)
        samplers = []
        for sampler_id in ("a", "b"):
            sampler_run = await runs.open(cfg.run.id, f"sampler-{sampler_id}", url=site.url)
            engine = HFEngine("tiny", cfg.lora, cfg.sampling)
            samplers.append(Sampler(cfg, sampler_id, sampler_run, engine, load_task(cfg.task)))
            await samplers[-1].weights.start()

        async def all_apply(version: int) -> None:
            for s in samplers:
                await asyncio.wait_for(s.weights.apply_newest(version), timeout=30)
                assert s.weights.version == version

        await all_apply(0)
        await weights.publish(1, adapters[1], TINY_BASE)
        await all_apply(1)
        for s in samplers:  # rollouts go on to the hub's stream through the relay's leaf connection
            await s.generation.generate_and_publish(Grant(slots=[1], prompts=[12]))

        site.stop()  # the relay goes down; the trainer publishes without it; it comes back
        await weights.publish(2, adapters[2], TINY_BASE)
        site.start()
        await all_apply(2)

        # Retention reaches the relay: after K+3 more versions, the mirror holds the chunks
        # of the same K versions as the hub, not all of them.
        for version in range(3, 7):
            await weights.publish(version, adapters[version], TINY_BASE)
        await all_apply(6)
        for _ in range(100):
            hub_chunks, relay_chunks = await _mirrored_chunk_sets(run, samplers[0].run)
            if hub_chunks == relay_chunks:
                break
            await asyncio.sleep(0.05)
        assert len(hub_chunks) == 3 and relay_chunks == hub_chunks

        assert all(s.weights.follower.failures == {} for s in samplers)
        for s in samplers:
            await s.weights.stop()
            await s.run.close()
        records = [r async for r in read_rollouts(hub.url, cfg.run.id)]
        assert sorted(r["headers"][HDR_SAMPLER_ID] for r in records) == ["a", "b"]


async def test_relays_chain_hub_to_site_to_subsite(hub, runs, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)

    with (relay(tmp_path, hub.leaf_url, cfg.run.id, "site") as site,
          relay(tmp_path, site.leaf_url, cfg.run.id, "subsite", upstream_domain="site") as subsite):
        run = await runs.open(cfg.run.id, "trainer", url=hub.url)
        weights = WeightsPublisher(await take_lease(run))
        await weights.publish(0, adapter_for_version(trainer_side, 0), TINY_BASE)
        sampler_run = await runs.open(cfg.run.id, "sampler-deep", url=subsite.url)
        sampler = Sampler(cfg, "deep", sampler_run, HFEngine("tiny", cfg.lora, cfg.sampling), load_task(cfg.task))
        await sampler.weights.start()
        await asyncio.wait_for(sampler.weights.apply_newest(0), timeout=30)
        await weights.publish(1, adapter_for_version(trainer_side, 1), TINY_BASE)
        await asyncio.wait_for(sampler.weights.apply_newest(1), timeout=30)
        await sampler.generation.generate_and_publish(Grant(slots=[1], prompts=[12]))  # two leaf hops up to the hub's stream
        await sampler.weights.stop()
        await sampler_run.close()
        records = [r async for r in read_rollouts(hub.url, cfg.run.id)]
        assert [r["headers"][HDR_SAMPLER_ID] for r in records] == ["deep"]


async def test_an_edge_sampler_behind_a_relay_reads_the_config_and_heartbeats_to_the_hub(hub, site, runs, tmp_path):
    cfg = tiny_config(tmp_path, run={"id": "edge"})
    args = build_parser().parse_args(["sampler", "--id", "far", "--nats", site.url, "--run-id", "edge"])

    run = await runs.open("edge", "trainer", url=hub.url)
    await run.state.put(CONFIG_KEY, cfg.model_dump_json().encode())
    relay_nc = await connect(site.url, "relay")
    await open_mirrors(relay_nc, RunNames("edge"), "hub")
    got = await sampler_config_from_run(args)  # a KV read through the leaf connection
    assert got.nats.url == site.url and got.sampling == cfg.sampling
    sampler_run = await runs.open("edge", "sampler-far", url=site.url)
    assert weights_relay(sampler_run, "hub") == "site" and weights_relay(run, "hub") == ""
    status = SamplerStatus(sampler_id="far", version=3, groups_published=1, weight_failures={}, updated_at=0.0)
    await put_status(sampler_run, status)  # a KV write through it

    async def grant_all(sampler_id, request):
        slots = list(range(1, request.want + 1)) if sampler_id == "far" else []
        return Grant(slots=slots, prompts=slots)

    await serve_grants(run, grant_all)
    # The hub tells the leaf of the trainer's interest a moment later.
    asked = GrantRequest(want=3, term=1, version=0)
    grant = await eventually_async(lambda: request_grant(sampler_run, "far", asked), 5)
    assert grant.groups == 3  # the trainer's answer through it
    assert await read_statuses(run) == [status]
    await relay_nc.close()
