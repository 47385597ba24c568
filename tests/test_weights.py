"""Weights on the wire against a real nats-server (streams/weights.py, streams/objects.py):
published, followed, retained, refused when damaged or misfit, and read by other clients."""

import asyncio
import base64
import io
import json
import os
import time

import pytest
import safetensors.torch
import torch

from echo.engines.hf import HFEngine
from echo.tasks import load_task
from echo.weights.shards import weights_shards
from echo.wire.messages import Grant
from echo.wire.names import HDR_VERSION, weights_object_name
from streams.client import direct_get_batch
from streams.lease import take_lease
from streams.objects import TransferError, get_object, put_object, sha256_hex
from streams.registry import put_status, read_statuses
from streams.replay import read_rollouts
from streams.weights import WeightsFollower, WeightsPublisher, fetch_weights
from tests.conftest import TINY_BASE, adapter_for_version, eventually_async, store_tampered, tiny_config
from workers.sampler.sampler import Sampler


async def test_weights_round_trip_and_a_wrong_digest_is_refused(runs, tmp_path):
    run = await runs.open("w", "test")
    weights = WeightsPublisher(await take_lease(run))
    data = bytes(range(256)) * 4000  # 1 MB: several object-store chunks
    announcement = await weights.publish(7, [data, data[:1000]], TINY_BASE, "full")
    assert await fetch_weights(run, announcement) == [data, data[:1000]]
    lie = announcement.shards[1].model_copy(update={"sha256": "0" * 64})
    lying = announcement.model_copy(update={"shards": [announcement.shards[0], lie]})
    with pytest.raises(TransferError, match="digest_mismatch"):
        await fetch_weights(run, lying)


async def test_a_sampler_joining_after_version_3_generates_with_version_3(runs, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [adapter_for_version(trainer_side, v) for v in range(4)]

    run = await runs.open(cfg.run.id, "trainer")
    weights = WeightsPublisher(await take_lease(run))
    for version, data in enumerate(adapters):
        await weights.publish(version, data, TINY_BASE)

    sampler_run = await runs.open(cfg.run.id, "late-sampler")
    engine = HFEngine("tiny", cfg.lora, cfg.sampling)
    sampler = Sampler(cfg, "late", sampler_run, engine, load_task(cfg.task))
    await sampler.weights.start()
    await sampler.weights.apply_newest()
    await sampler.generation.generate_and_publish(Grant(slots=[1], prompts=[12]))
    # A damaged version 4 is refused, the sampler stays on 3, and its heartbeat says why.
    await store_tampered(weights, 4, adapters[0][0], lambda chunks: [bytes([c[0] ^ 0xFF]) + c[1:] for c in chunks])
    await eventually_async(lambda: sampler.weights.follower.failures, 4)  # refused: the asserts say why
    await sampler.weights.apply_newest()
    await put_status(sampler_run, sampler.heartbeat.status())
    [status] = await read_statuses(run)
    assert (status.sampler_id, status.version, status.groups_published) == ("late", 3, 1)
    assert set(status.weight_failures) == {"digest_mismatch"}  # refused (and retried: it may count 2)
    await sampler.weights.stop()
    assert sampler.weights.version == 3
    assert list(weights_shards(engine.model, 2**30)) == adapters[3]
    records = [r async for r in read_rollouts(runs.url, cfg.run.id)]
    assert [r["headers"][HDR_VERSION] for r in records] == ["3"]


async def test_follower_refuses_an_adapter_for_another_base_model(runs, tmp_path):
    run = await runs.open("b", "test")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, [b"good"], TINY_BASE)
    follower = await WeightsFollower(run, TINY_BASE).start()
    assert (await follower.wait_for(0))[1] == [b"good"]
    await weights.publish(1, [b"other"], "some-other-model")
    await eventually_async(lambda: follower.failures, 4)
    assert follower.failures == {"wrong_base_model": 1}
    assert follower.ready[0].version == 0  # the old version stays
    await follower.stop()


async def test_the_bucket_keeps_only_the_newest_versions(runs):
    run = await runs.open("keep", "test")
    weights = WeightsPublisher(await take_lease(run), keep=2)
    async def stored() -> list[str]:
        return sorted(info.name for info in await run.weights.list(ignore_deletes=True))

    shards = [b"a" * 1000, b"b" * 1000]
    announcements = [await weights.publish(v, shards, TINY_BASE) for v in range(5)]
    assert await stored() == sorted(s.object_name for a in announcements[-2:] for s in a.shards)
    assert await fetch_weights(run, announcements[-1]) == shards
    with pytest.raises(TransferError, match="not_found"):
        await fetch_weights(run, announcements[0])
    await run.close()
    run = await runs.open("keep", "test")  # a restarted trainer sweeps what is left once
    weights = WeightsPublisher(await take_lease(run), keep=1)
    latest = await weights.publish(5, shards[:1], TINY_BASE)
    assert await stored() == [latest.shards[0].object_name]


async def test_a_version_a_slow_sampler_is_fetching_stays_for_keep_seconds(runs):
    """Counted in versions alone (keep_seconds 0), a version goes `keep` publishes after it came,
    so a fetch longer than that many steps never finished. Kept `keep_seconds` past its
    successor's announcement, it can."""
    run = await runs.open("slow-link", "test")
    weights = WeightsPublisher(await take_lease(run), keep=1, keep_seconds=60)
    started = await weights.publish(0, [b"v0" * 500], TINY_BASE)
    for version in (1, 2, 3):  # the trainer goes on while a sampler is still reading version 0
        await weights.publish(version, [b"vN" * 500], TINY_BASE)
    assert await fetch_weights(run, started) == [b"v0" * 500]
    weights.keep_seconds = 0
    await weights.publish(4, [b"vN" * 500], TINY_BASE)
    with pytest.raises(TransferError, match="not_found"):
        await fetch_weights(run, started)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda chunks: [chunks[0][:-1] + b"!", *chunks[1:]],  # one byte of one chunk changed
        lambda chunks: chunks[: len(chunks) // 2],  # truncated: half the chunks gone
    ],
    ids=["corrupt-chunk", "truncated"],
)
async def test_a_damaged_adapter_is_refused_the_old_version_kept_and_the_fetch_retried(runs, tamper, monkeypatch):
    """A damaged object is refused (the old weights stay) and fetched again with backoff while
    its announcement is the newest: once the object is whole again (here: stored again, as a
    trainer's retry or a relay's re-mirror would), the follower takes it without a new
    announcement. Before, it waited for a newer version: forever, in sequential mode."""
    monkeypatch.setattr("streams.objects.REPLICA_LAG_S", 0.2)  # one server: no replica lags another
    run = await runs.open("damage", "test")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, [b"good" * 100_000], TINY_BASE)
    follower = await WeightsFollower(run, TINY_BASE).start()
    assert (await follower.wait_for(0))[0].version == 0
    adapter = bytes(range(256)) * 2000
    await store_tampered(weights, 1, adapter, tamper)
    await eventually_async(lambda: sum(follower.failures.values()) >= 2, 5)  # refused, and tried again
    assert set(follower.failures) <= {"digest_mismatch", "truncated", "size_mismatch"}
    assert follower.ready[0].version == 0 and follower.ready[1] == [b"good" * 100_000]
    await put_object(run.js, run.names.weights_bucket, weights_object_name(weights.term, 1, 0), adapter)  # repaired
    async with asyncio.timeout(5):
        assert (await follower.wait_for(1))[1] == [adapter]
    await weights.publish(2, [b"next" * 1000], TINY_BASE)  # and it still takes the next good one
    assert (await follower.wait_for(2))[1] == [b"next" * 1000]
    await follower.stop()
    assert follower._task.done()  # ended, not just told to: the connection closes next


async def test_a_read_cancelled_once_its_connection_closed_ends_cancelled(runs):
    """A sampler's teardown cancels its weights' fetch after its connection closed. The read's
    cleanup (an unsubscribe) then failed 'connection closed', in place of the cancellation: the
    fetch took it for a broker's failure and tried again, every 15 s, for good, and the process
    never ended (bench.load at 1,000 samplers, 2026-12-07)."""
    run = await runs.open("cancelled-read", "test")
    silent = await run.nc.subscribe("silent.DIRECT.GET.stream")  # takes the request, never answers
    silent_api = run.nc.jetstream(prefix="silent")
    reading = asyncio.create_task(direct_get_batch(silent_api, "stream", {"multi_last": ["x"]}, 60))
    await eventually_async(lambda: silent.pending_msgs == 1, 5)
    await run.nc.close()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_follower_stopped_and_stopped_again_at_once_leaves_nothing_running(runs):
    """A sampler's teardown may itself be cancelled (cancel_until_done cancels again after 0.5 s):
    the follower's fetch stopped first, its following of the announcements was left polling a
    closed connection (1,000 samplers, 5% of them restarted in place: bench.load)."""
    run = await runs.open("stopped-twice", "test")
    follower = await WeightsFollower(run, TINY_BASE).start()
    stopping = asyncio.create_task(follower.stop())
    await asyncio.sleep(0)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    await eventually_async(lambda: (follower._task.done(), follower._announcements.task.done()) == (True, True), 5)


async def test_chunks_a_replica_lacks_yet_are_waited_for_and_chunks_none_has_are_not(runs, monkeypatch):
    """CI, 2026-11-29: just after a 3-node cluster's failover a read of an object whole on the
    leader failed 'truncated: 0 of 32 chunks stored': direct gets are answered by any replica, the
    info came from one and the chunks from one behind it. One server stands in for the replica
    behind: the info is there and its chunks come 0.5 s later. Chunks that never come are still
    refused, once REPLICA_LAG_S has passed."""
    run = await runs.open("lagging", "test")
    bucket, data = run.names.weights_bucket, os.urandom(3 << 20)
    info = await put_object(run.js, bucket, "w", data)
    subject = f"$O.{bucket}.C.{info.nuid}"
    request = {"next_by_subj": subject, "seq": 1, "batch": info.chunks}
    chunks = [m.data for m in await direct_get_batch(run.js, f"OBJ_{bucket}", request, 5)]
    await run.js.purge_stream(f"OBJ_{bucket}", subject=subject)
    reading = asyncio.create_task(get_object(run.js, bucket, "w", sha256_hex(info), len(data)))
    await asyncio.sleep(0.5)
    assert not reading.done()
    for chunk in chunks:
        await run.js.publish(subject, chunk)
    assert await reading == data
    await run.js.purge_stream(f"OBJ_{bucket}", subject=subject)
    monkeypatch.setattr("streams.objects.REPLICA_LAG_S", 0.5)
    began = time.monotonic()
    with pytest.raises(TransferError, match="truncated: 0 of 3 chunks"):
        await get_object(run.js, bucket, "w", sha256_hex(info), len(data))
    assert time.monotonic() - began >= 0.5


async def test_an_announced_object_a_replica_has_not_applied_yet_is_waited_for_and_one_never_put_is_not(
        runs, monkeypatch):
    """CI, 2026-12-07: an object put through a 3-node cluster's new leader was 'not_found' when read
    back at once: the direct get was answered by a replica that had not applied its info yet. One
    server stands in for that replica: the info comes 0.5 s after the read began. An object the
    caller was told of (by its digest) is read again for up to REPLICA_LAG_S; one that never
    comes is still not found then, and a read that names no digest (a look whether it is there)
    is answered at once."""
    run = await runs.open("unapplied", "test")
    bucket, data = run.names.weights_bucket, os.urandom(1 << 20)
    info = await put_object(run.js, bucket, "w", data)
    meta_subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(b'w').decode()}"
    meta = (await run.js.get_last_msg(f"OBJ_{bucket}", meta_subject)).data
    await run.js.purge_stream(f"OBJ_{bucket}", subject=meta_subject)
    reading = asyncio.create_task(get_object(run.js, bucket, "w", sha256_hex(info), len(data)))
    await asyncio.sleep(0.5)
    assert not reading.done()
    await run.js.publish(meta_subject, meta, headers={"Nats-Rollup": "sub"})
    assert await reading == data
    with pytest.raises(TransferError, match="not_found"):
        await get_object(run.js, bucket, "never-put")
    monkeypatch.setattr("streams.objects.REPLICA_LAG_S", 0.5)
    began = time.monotonic()
    with pytest.raises(TransferError, match="not_found"):
        await get_object(run.js, bucket, "never-put", sha256_hex(info), len(data))
    assert time.monotonic() - began >= 0.5


async def test_an_object_larger_than_announced_is_refused_before_its_buffer_is_allocated(runs):
    """An object's info is what the reader allocates for: one claiming a terabyte is refused by
    the announced size first (before: MemoryError, or a swapping box)."""
    run = await runs.open("huge", "test")
    bucket = run.names.weights_bucket
    info = await put_object(run.js, bucket, "w", b"x" * 16)
    forged = info.as_dict() | {"size": 1 << 40}
    name_subject = base64.urlsafe_b64encode(b"w").decode()
    await run.js.publish(f"$O.{bucket}.M.{name_subject}", json.dumps(forged).encode(), headers={"Nats-Rollup": "sub"})
    with pytest.raises(TransferError, match="size_mismatch"):
        await get_object(run.js, bucket, "w", expected_size=16)


async def test_a_follower_that_fails_tells_whoever_waits_for_weights(runs, monkeypatch):
    """An error the fetch loop does not expect ends it, and the next wait raises it instead of
    hanging: a sampler must not heartbeat on while frozen on old weights."""
    async def broken_fetch(run, announcement):
        raise KeyError("a bug in our own code")

    run = await runs.open("broken", "test")
    weights = WeightsPublisher(await take_lease(run))
    follower = await WeightsFollower(run, TINY_BASE).start()
    monkeypatch.setattr("streams.weights.fetch_weights", broken_fetch)
    await weights.publish(0, [b"w"], TINY_BASE)
    async with asyncio.timeout(5):
        with pytest.raises(RuntimeError, match="weights follower stopped") as raised:
            await follower.wait_for(0)
    assert isinstance(raised.value.__cause__, KeyError)
    await follower.stop()


async def test_our_objects_and_the_libraries_read_each_other(runs):
    run = await runs.open("interop", "test")
    bucket, data = run.names.weights_bucket, bytes(range(256)) * 12_000  # 3 MB: several chunks
    await put_object(run.js, bucket, "ours", data, headers={"policy-version": ["4"]})
    library_read = io.BytesIO()
    await run.weights.get("ours", writeinto=library_read)  # the standard client checks the digest too
    assert library_read.getvalue() == data
    assert (await run.weights.get_info("ours")).headers == {"policy-version": ["4"]}
    await run.weights.put("theirs", data)
    assert await get_object(run.js, bucket, "theirs") == data
    await put_object(run.js, bucket, "ours", b"replaced")  # same name: the old chunks are purged
    assert await get_object(run.js, bucket, "ours") == b"replaced"
    await put_object(run.js, bucket, "empty", b"")
    assert await get_object(run.js, bucket, "empty") == b""


async def test_weights_the_engine_refuses_are_tried_once_and_not_waited_on(runs, tmp_path):
    """A version that does not fit the model (here: other tensor names) is refused once; the
    sampler neither reloads it on every loop nor wakes up for it again, and takes the next one."""
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    good = adapter_for_version(trainer_side, 2)
    misfit = safetensors.torch.save({"not_a_lora_tensor": torch.zeros(3)})

    run = await runs.open(cfg.run.id, "trainer")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, adapter_for_version(trainer_side, 0), TINY_BASE)
    sampler_run = await runs.open(cfg.run.id, "sampler", create=False)
    sampler = Sampler(cfg, "s1", sampler_run, HFEngine("tiny", cfg.lora, cfg.sampling), load_task(cfg.task))
    await sampler.weights.start()
    await sampler.weights.apply_newest()
    await weights.publish(1, [misfit], TINY_BASE)
    await sampler.weights.follower.wait_for(1)
    for _ in range(3):
        await sampler.weights.apply_newest()
    assert sampler.weights.follower.failures == {"weights_mismatch": 1} and sampler.weights.version == 0
    with pytest.raises(TimeoutError):  # before: version 1 was "newer" at once, a busy loop
        await asyncio.wait_for(sampler.weights.wait_newer(), 0.3)
    await weights.publish(2, good, TINY_BASE)
    await sampler.weights.follower.wait_newer(sampler.weights.refused)
    await sampler.weights.apply_newest()
    assert sampler.weights.version == 2
    await sampler.weights.stop()
