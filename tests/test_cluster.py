"""A 3-node JetStream cluster as the broker: every stream and bucket on three nodes, clients
given every node's URL, one node down without losing anything acknowledged."""

import asyncio
import os
import signal
import statistics
import time

import pytest

from bench.rolling import Writers, restart
from echo.wire.names import Storage
from streams.client import BROKER_ERRORS, retry_forever
from streams.lease import HELD_S, RENEW_S, AnotherTrainer, take_lease
from streams.objects import ACK_TIMEOUT_S, get_object, put_object, sha256_hex
from streams.rollouts import publish_rollout
from streams.server import ELECTION_MIN_S, NatsCluster
from tests.conftest import eventually_async
from tests.groups import honest_group
from workers.trainer.publishing import PUBLISH_RETRY_MAX_S


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



async def test_a_rolling_restart_under_load_loses_nothing_and_waits_for_no_election(cluster, runs):
    """Planned maintenance (a rolling restart): each node in turn stopped (SIGTERM), started again, and its
    replicas let catch up before the next, while rollouts are published and the state bucket is
    written without a pause. nats-server's shutdown hands each raft group it leads to a peer, and
    a request whose connection dropped is failed at once and sent again (RequestLost), so nothing
    waits as long as an election would (a follower campaigns only ELECTION_MIN_S after its
    leader's last word); every acknowledged rollout is in the stream once. (Before RequestLost, a
    publish on the stopped node's connection waited out its 10 s timeout; killed instead of
    stopped, a node's groups stall writes for an election: bench/rolling.py.) A write that reached
    a leader as its leadership moved got no answer at all: CI, 2026-12-06, saw a publish wait out
    10 s and a KV write 5 s so; small writes now wait WRITE_TIMEOUT_S for their ack."""
    run = await runs.open("r3", "trainer", url=cluster.url, storage=Storage(replicas=3), mirror_wait_s=60)
    writers = Writers(run)
    try:
        await asyncio.sleep(1.0)
        for i in range(len(cluster.nodes)):
            await restart(cluster, run, i)
    finally:
        await writers.stop()
    assert max(writers.longest.values()) < ELECTION_MIN_S, writers.longest
    assert await writers.all_there()


async def test_a_weights_publish_whose_stream_leader_is_killed_goes_on_once_a_new_one_is_elected(cluster, runs):
    """Recovery from a leader's death: with a node killed mid-publish, a chunk's ack never came and the publish waited
    out a 30 s timeout (34 s where 3 s was the norm). It now gives up on an ack within
    ACK_TIMEOUT_S (at once when its connection dropped) and tries again every PUBLISH_RETRY_MAX_S
    at most, so it ends within the broker's own failover (a raft election: a follower campaigns
    4-9 s after the leader's last heartbeat, raft.go) and one more publish."""
    run = await runs.open("r3", "trainer", url=cluster.url, storage=Storage(replicas=3), mirror_wait_s=60)
    bucket, data = run.names.weights_bucket, os.urandom(32 << 20)

    async def publish(name):
        began = time.monotonic()
        await put_object(run.js, bucket, name, data)
        return time.monotonic() - began

    seconds = [await publish(name) for name in ("v0", "v1", "v2")]
    leader = (await run.js.stream_info(f"OBJ_{bucket}")).cluster.leader

    async def elected():  # when the broker's failover ended, as this client sees it
        try:
            if (await run.js.stream_info(f"OBJ_{bucket}")).cluster.leader not in (None, leader):
                return time.monotonic() - began
        except BROKER_ERRORS:
            return None

    began = time.monotonic()
    publishing = asyncio.create_task(retry_forever("publish", lambda: put_object(run.js, bucket, "v3", data),
                                                   max_delay_s=PUBLISH_RETRY_MAX_S))
    await asyncio.sleep(statistics.median(seconds) / 3)  # mid-publish
    node = next(node for node in cluster.nodes if node.config.server_name == leader)
    node.process.send_signal(signal.SIGKILL)
    election = await eventually_async(elected, 60, every=0.2)
    info = await publishing
    took = time.monotonic() - began
    # One publish's time, before and after: the box's load may change while this runs (the
    # guarantee is against waiting out a 30 s ack, not this machine's speed).
    seconds.append(await publish("v4"))
    assert took < election + ACK_TIMEOUT_S + PUBLISH_RETRY_MAX_S + 3 * max(seconds), (took, election, seconds)
    assert bytes(await get_object(run.js, bucket, "v3", sha256_hex(info), len(data))) == data


async def test_a_trainer_whose_state_leader_is_killed_waits_it_out_and_never_works_beside_a_standby(cluster, runs):
    """A lease through a failover: killing a cluster node failed the trainer's lease renewals for ~4 s while it went
    on checkpointing and announcing, the time after which a standby may take over. With the state
    stream's leader killed, the holder acts only within HELD_S of a renewal the broker confirmed,
    a standby trying to take the run meanwhile takes it only once the holder stopped acting (or
    finds it renewed), and the holder goes on once the failover is over."""
    holder = await runs.open("r3", "trainer", url=cluster.url, storage=Storage(replicas=3), mirror_wait_s=60)
    standby = await runs.open("r3", "standby", url=cluster.url, storage=Storage(replicas=3), mirror_wait_s=60)
    lease = await take_lease(holder)
    renewing = asyncio.create_task(lease.renew_forever())
    acted = []  # (when the holder was let act, when the renewal it stood on was sent)

    async def act():
        while True:
            await lease.held()
            acted.append((time.monotonic(), lease.renewed_at))
            await asyncio.sleep(0.05)

    async def take_over() -> float | None:  # a standby started as a supervisor would: until it knows
        while True:
            try:
                await take_lease(standby)
                return time.monotonic()
            except AnotherTrainer:
                return None
            except BROKER_ERRORS:
                await asyncio.sleep(0.25)

    acting = asyncio.create_task(act())
    try:
        await asyncio.sleep(2 * RENEW_S)
        leader = (await holder.js.stream_info(f"KV_{holder.names.state_bucket}")).cluster.leader
        next(node for node in cluster.nodes if node.config.server_name == leader).process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        taken = await asyncio.wait_for(take_over(), 60)
        assert all(now - renewed < HELD_S + 0.5 for now, renewed in acted), acted  # 0.5: one act's own wait
        if taken is None:  # renewed again before the standby saw the lease lapse: the holder goes on
            await eventually_async(lambda: acted and acted[-1][1] > killed, 30, every=0.1)
            assert lease.lost is None
        else:  # taken over: the holder had stopped acting before, and is fenced out
            assert acted[-1][0] < taken, (acted[-1], taken)
            async with asyncio.timeout(30):
                with pytest.raises(AnotherTrainer):
                    await acting
    finally:
        renewing.cancel()
        acting.cancel()
