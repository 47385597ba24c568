"""A 3-node JetStream cluster as the broker: every stream and bucket on three nodes, clients
given every node's URL, one node down without losing anything acknowledged."""

import asyncio
import signal

import pytest

from echo.protocol import Storage
from streams.client import BROKER_ERRORS
from streams.rollouts import publish_rollout
from streams.server import NatsCluster
from tests.groups import honest_group


@pytest.fixture
def cluster(tmp_path):
    with NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path) as cluster:
        yield cluster


async def test_a_run_on_a_cluster_keeps_three_copies_and_survives_a_node_killed(cluster, runs):
    run = await runs.open("r3", "trainer", url=cluster.url, storage=Storage(replicas=3), mirror_wait_s=60)
    names = run.names
    for stream in (names.rollouts_stream, names.control_stream, names.weights_stream,
                   f"KV_{names.state_bucket}"):
        assert (await run.js.stream_info(stream)).config.num_replicas == 3, stream
    for i in range(3):
        await publish_rollout(run, honest_group(20 + i, group_id=f"before{i}"))
    node = cluster.nodes[0]
    node.process.send_signal(signal.SIGKILL)  # maybe the very node this client talks to
    node.process.wait()
    async with asyncio.timeout(60):  # a new leader where it led, the client on another node
        while True:
            try:
                await publish_rollout(run, honest_group(30, group_id="after"))
                break
            except BROKER_ERRORS:
                await asyncio.sleep(0.5)
    info = await run.js.stream_info(names.rollouts_stream)
    assert info.state.messages == 4  # every acknowledged publish is there

