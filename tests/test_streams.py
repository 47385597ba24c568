"""The wire against a real nats-server: rollouts in and out, malformed input, weights."""

import asyncio
import base64
import hashlib
import io
import json

import nats.js.errors
import pytest
import safetensors.torch
import torch

from echo.consumed import ConsumedSeqs
from echo.engines.hf import HFEngine
from echo.policy import weights_shards
from echo.referee import Referee, content_hash
from echo.config import SamplingConfig
from echo.protocol import HDR_BODY_PARTS, HDR_BODY_SHA256, HDR_BODY_SIZE, HDR_MSG_ID, HDR_POLICY_VERSION, HDR_SAMPLER_ID, SCHEDULE_KEY, TRAINER_CONSUMER, SamplerStatus, Schedule, encode, encode_rollout, rollout_headers, weights_object_name
from echo.tasks import load_task
from streams.lease import take_lease
from streams.objects import TransferError, get_object, put_object
from streams.registry import put_status, read_statuses
from streams.replay import read_rollouts
from streams.inbox import RolloutInbox
from streams.rollouts import publish_rollout, rollout_body, trainer_subscription
from streams.schedule import publish_schedule, watch_schedule
from streams.server import NatsServer
from streams.weights import WeightsFollower, WeightsPublisher, fetch_weights
from tests.conftest import adapter_for_version, store_tampered, TINY_BASE, tiny_config
from tests.groups import REFEREE, TASK, TOKENIZER, honest_group, with_completion
from workers.sampler.loop import Sampler
from workers.trainer.intake import Collector, Judge, Timeline


async def test_collector_uses_fresh_groups_and_rejects_the_rest_with_reasons(runs):
    run = await runs.open("c")
    inbox = await RolloutInbox.open(run)
    subject = run.names.rollouts_subject("s1")
    await run.js.publish(subject, b"{broken", headers={HDR_MSG_ID: "bad1", HDR_SAMPLER_ID: "s1"})
    await publish_rollout(run, honest_group(policy_version=1, group_id="stale"))  # 5 - 1 > bound
    await publish_rollout(run, honest_group(policy_version=9, group_id="future"))
    await publish_rollout(run, honest_group(policy_version=5, group_id="wrongsize", texts=["a", "b", "c"]))
    spoofed = honest_group(policy_version=5, group_id="spoofed")
    await run.js.publish(subject, encode_rollout(spoofed), headers={**rollout_headers(spoofed), HDR_POLICY_VERSION: "4"})
    liar = with_completion(honest_group(policy_version=4, group_id="liar"), reward=0.0)
    await publish_rollout(run, liar)
    # Attacks by a sampler with publish rights: s1's group on s2's subject; the liar's completions
    # re-sent under a new id; a group trained on in an earlier step re-sent under a new id.
    impostor = honest_group(15, policy_version=5, group_id="imp")
    await run.js.publish(run.names.rollouts_subject("s2"), encode_rollout(impostor), headers=rollout_headers(impostor))
    await publish_rollout(run, honest_group(policy_version=5, group_id="replay"))
    await publish_rollout(run, honest_group(13, policy_version=5, group_id="old"))
    await publish_rollout(run, honest_group(14, policy_version=5, group_id="ok"))
    await publish_rollout(run, honest_group(14, policy_version=5, group_id="ok"))  # a retry: de-duplicated

    trained_earlier = content_hash(honest_group(13))
    collector = Collector(inbox, Judge(REFEREE, Timeline(max_staleness=1), trained_content={trained_earlier}))
    collected = await collector.collect(2, version=5)
    assert [a.group.group_id for a in collected.used] == ["liar", "ok"]
    assert collected.used[0].rewards == [1.0, 0.1]  # the trainer's rewards, not the liar's
    assert collected.reward_mismatch == {"s1": 1}
    assert collected.dropped == {4: 1} and collected.dropped_ids == ["stale"]
    assert collected.rejected == {"bad_encoding": 1, "future_version": 1, "wrong_group_size": 1, "header_mismatch": 1,
                                  "subject_mismatch": 1, "replayed_content": 2}
    info = await run.js.consumer_info(run.names.rollouts_stream, TRAINER_CONSUMER)
    assert info.num_pending == 0 and info.num_ack_pending == 10  # all wait for the step's checkpoint
    # What waits holds a body only if its group is trained: junk costs the step no memory.
    assert sorted(len(d.msg.data) > 0 for d in inbox.held) == [False] * 8 + [True] * 2
    assert await inbox.ack_held() == 0  # every ack confirmed
    info = await run.js.consumer_info(run.names.rollouts_stream, TRAINER_CONSUMER)
    assert info.num_ack_pending == 0  # confirmed
    # Nothing is lost: rejected messages stay in the stream for replay.
    records = [r async for r in read_rollouts(runs.url, "c")]
    assert len(records) == 10 and sum("error" in r for r in records) == 3
    assert len(collected.seqs) == 10 == len(collected.used) + len(collected.dropped_ids) + sum(
        collected.rejected.values())


@pytest.fixture
def small_messages_server(tmp_path):
    """A nats-server whose messages are at most 64 KB."""
    with NatsServer(tmp_path / "js", max_payload="64KB") as server:
        yield server


async def test_a_group_larger_than_a_message_travels_in_parts_and_bad_parts_are_refused(small_messages_server, runs):
    """A reasoning-length group does not fit in one message: the sampler publishes its body in
    parts on its own bodies subject, the trainer reads them back and checks subject, size and digest."""
    run = await runs.open("big", url=small_messages_server.url)
    inbox = await RolloutInbox.open(run)
    answer = TASK.prompt(12).answer
    big = honest_group(texts=["x" * 30_000 + f"\\boxed{{{answer}}}", "y" * 30_000 + "\\boxed{999}"],
                       policy_version=5, group_id="big")
    assert len(encode_rollout(big)) > 4 * run.nc.max_payload
    # Pointers that do not add up: a part that does not match the digest; a part missing; a
    # thousand parts; and s2 naming a part that s1 published (the trainer reads the parts on the
    # subject's sampler's bodies subject only).
    forged = honest_group(policy_version=5, group_id="forged")
    junk = await run.js.publish(run.names.bodies_subject("s1"), b"junk", headers={HDR_MSG_ID: "forged-0"})
    pointer = {**rollout_headers(forged), HDR_BODY_PARTS: str(junk.seq), HDR_BODY_SIZE: "4", HDR_BODY_SHA256: "0" * 64}
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers=pointer)
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={
        **pointer, HDR_MSG_ID: "forged2", HDR_BODY_PARTS: "999999"})
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={  # refused before reading a thousand parts
        **pointer, HDR_MSG_ID: "forged3", HDR_BODY_PARTS: ",".join(["1"] * 1000)})
    stolen = encode_rollout(honest_group(policy_version=5, group_id="stolen", sampler_id="s2"))
    part = await run.js.publish(run.names.bodies_subject("s1"), stolen, headers={HDR_MSG_ID: "stolen-0"})
    await run.js.publish(run.names.rollouts_subject("s2"), b"", headers={
        **rollout_headers(honest_group(policy_version=5, group_id="stolen", sampler_id="s2")),
        HDR_BODY_PARTS: str(part.seq), HDR_BODY_SIZE: str(len(stolen)),
        HDR_BODY_SHA256: hashlib.sha256(stolen).hexdigest()})
    await publish_rollout(run, big)
    referee = Referee(TASK, TOKENIZER, len(TOKENIZER), SamplingConfig(group_size=2, max_new_tokens=40_000, temperature=1.0))
    collector = Collector(inbox, Judge(referee, Timeline(max_staleness=1)))
    collected = await collector.collect(1, version=5)
    assert [a.group for a in collected.used] == [big] and collected.used[0].rewards == [1.0, 0.1]
    assert collected.rejected == {"bad_body": 4}
    records = [r async for r in read_rollouts(small_messages_server.url, "big")]
    assert [r["group"]["group_id"] for r in records if "group" in r] == ["big"]
    assert sum("bad_body" in r.get("error", "") for r in records) == 4


async def test_a_step_that_crashed_between_its_checkpoint_and_its_acks_is_not_counted_twice(runs):
    """The checkpoint names the stream sequences its step consumed; when they come back (the
    trainer died before acking them), the next trainer skips them, and counts the rest."""
    run = await runs.open("redeliver", "test")
    for i in range(3):
        await publish_rollout(run, honest_group(20 + i, policy_version=5, group_id=f"g{i}"))
    first = Collector(await RolloutInbox.open(run, ack_wait_s=600.0), Judge(REFEREE, Timeline(max_staleness=1)))
    step = await first.collect(2, version=5)  # checkpointed, then the crash: never acked
    assert [a.group.group_id for a in step.used] == ["g0", "g1"]
    await publish_rollout(run, honest_group(23, policy_version=5, group_id="g3"))
    # Opening the inbox offers g0 and g1 again at once (not after ack_wait), before newer messages.
    restarted = Collector(await RolloutInbox.open(run, ack_wait_s=600.0), Judge(REFEREE, Timeline(max_staleness=1)),
                          consumed=ConsumedSeqs(above=step.seqs))
    again = await restarted.collect(2, version=5)
    assert [a.group.group_id for a in again.used] == ["g2", "g3"] and again.already_counted == 2
    assert set(again.seqs).isdisjoint(step.seqs)


async def test_the_trainer_keeps_the_rollout_history_its_config_allows_and_can_change_it(runs, tmp_path):
    cfg = tiny_config(tmp_path, nats={"rollouts_max_gb": 0.5, "rollouts_max_age_h": 2})

    run = await runs.open("limits", "trainer", storage=cfg.nats.storage())
    limits = (await run.js.stream_info(run.names.rollouts_stream)).config
    assert (limits.max_bytes, limits.max_age) == (2**29, 7200)
    await run.close()
    run = await runs.open("limits", "trainer")  # restarted with the defaults: no limit
    limits = (await run.js.stream_info(run.names.rollouts_stream)).config
    assert limits.max_bytes == -1 and not limits.max_age


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


async def _until_failure(follower: WeightsFollower, timeout: float = 4.0) -> None:
    """Wait for the follower to count a refused adapter; the caller's asserts say which."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not follower.failures and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


async def test_a_sampler_joining_after_version_3_generates_with_version_3(runs, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [adapter_for_version(trainer_side, v) for v in range(4)]

    run = await runs.open(cfg.run.id, "trainer")
    weights = WeightsPublisher(await take_lease(run))
    await trainer_subscription(run)
    for version, data in enumerate(adapters):
        await weights.publish(version, data, TINY_BASE)

    sampler_run = await runs.open(cfg.run.id, "late-sampler")
    engine = HFEngine("tiny", cfg.lora, cfg.sampling)
    sampler = Sampler(cfg, "late", sampler_run, engine, load_task(cfg.task))
    await sampler.weights.start()
    await sampler.weights.apply_newest()
    await sampler.generation.generate_and_publish([1])
    # A damaged version 4 is refused, the sampler stays on 3, and its heartbeat says why.
    await store_tampered(weights, 4, adapters[0][0], lambda chunks: [bytes([c[0] ^ 0xFF]) + c[1:] for c in chunks])
    await _until_failure(sampler.weights.follower)
    await sampler.weights.apply_newest()
    await put_status(sampler_run, sampler.heartbeat.status())
    [status] = await read_statuses(run)
    assert (status.sampler_id, status.version, status.groups_published) == ("late", 3, 1)
    assert set(status.weight_failures) == {"digest_mismatch"}  # refused (and retried: it may count 2)
    await sampler.weights.stop()
    assert sampler.weights.version == 3
    assert list(weights_shards(engine.model, 2**30)) == adapters[3]
    records = [r async for r in read_rollouts(runs.url, cfg.run.id)]
    assert [r["headers"][HDR_POLICY_VERSION] for r in records] == ["3"]


async def test_follower_refuses_an_adapter_for_another_base_model(runs, tmp_path):
    run = await runs.open("b", "test")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, [b"good"], TINY_BASE)
    follower = await WeightsFollower(run, TINY_BASE).start()
    assert (await follower.wait_for(0))[1] == [b"good"]
    await weights.publish(1, [b"other"], "some-other-model")
    await _until_failure(follower)
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
async def test_a_damaged_adapter_is_refused_the_old_version_kept_and_the_fetch_retried(runs, tamper):
    """A damaged object is refused (the old weights stay) and fetched again with backoff while
    its announcement is the newest: once the object is whole again (here: stored again, as a
    trainer's retry or a relay's re-mirror would), the follower takes it without a new
    announcement. Before, it waited for a newer version: forever, in sequential mode."""
    run = await runs.open("damage", "test")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, [b"good" * 100_000], TINY_BASE)
    follower = await WeightsFollower(run, TINY_BASE).start()
    assert (await follower.wait_for(0))[0].version == 0
    adapter = bytes(range(256)) * 2000
    await store_tampered(weights, 1, adapter, tamper)
    async with asyncio.timeout(5):
        while sum(follower.failures.values()) < 2:  # refused, and tried again
            await asyncio.sleep(0.02)
    assert set(follower.failures) <= {"digest_mismatch", "truncated", "size_mismatch"}
    assert follower.ready[0].version == 0 and follower.ready[1] == [b"good" * 100_000]
    await put_object(run.js, run.names.weights_bucket, weights_object_name(weights.epoch, 1, 0), adapter)  # repaired
    async with asyncio.timeout(5):
        assert (await follower.wait_for(1))[1] == [adapter]
    await weights.publish(2, [b"next" * 1000], TINY_BASE)  # and it still takes the next good one
    assert (await follower.wait_for(2))[1] == [b"next" * 1000]
    await follower.stop()
    assert follower._task.done()  # ended, not just told to: the connection closes next


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


async def test_a_bad_or_misnamed_heartbeat_is_skipped_not_fatal(runs):
    """A sampler's credentials let it write its own heartbeat key, with any value: garbage, or a
    status naming another sampler. Readers (the scheduler, `echo-rl status`) skip both."""

    run = await runs.open("beats", "trainer")
    honest = SamplerStatus(sampler_id="s1", version=0, groups_published=0, weight_failures={}, updated_at=0.0)
    await put_status(run, honest)
    await run.registry.put("s2", b"junk")
    await run.registry.put("s0", encode(honest))  # s0 speaking for s1
    assert await read_statuses(run) == [honest]


async def test_a_bad_schedule_value_is_skipped_and_the_next_good_one_followed(runs):
    run = await runs.open("schedule", "trainer")
    seen = asyncio.Queue()
    watching = asyncio.create_task(watch_schedule(run, seen.put_nowait))
    await run.state.put(SCHEDULE_KEY, b"junk")
    schedule = Schedule(active=["s1"], standby=["s2"], predicted_utilisation=0.5, cost_per_step=1.0, why="test",
                        updated_at=0.0)
    await publish_schedule(run, schedule)
    async with asyncio.timeout(10):
        assert await seen.get() == schedule
    assert not watching.done()
    watching.cancel()


async def test_a_restarted_trainer_given_another_ack_wait_has_it(runs):
    """Held messages come back after ack_wait: a trainer restarted with a longer one must get
    it, not the consumer's first (its keep-alive runs at a third of the new one)."""

    run = await runs.open("ackwait", "trainer")
    await trainer_subscription(run, ack_wait_s=60.0)
    await trainer_subscription(run, ack_wait_s=600.0)
    info = await run.js.consumer_info(run.names.rollouts_stream, TRAINER_CONSUMER)
    assert info.config.ack_wait == 600.0


async def test_a_backlog_of_long_groups_is_fetched_without_dropping_the_trainers_connection(runs):
    """40 groups of 16 x 16,384 tokens (2.9 MB each) waiting, fetched 64 at a time (a step's
    groups): 40 x 2.9 MB pending to one client is over the server's max_pending (64 MB), the
    server closed the trainer's connection and the lost batch came back only after ack_wait
    (600 s). The rollouts stream now holds no message over ROLLOUT_MESSAGE_MAX (a long group's
    body goes in parts, read one by one), and a fetch asks for no more than the server holds for
    one client."""
    run = await runs.open("backlog")
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    body = bytes(2_900_000)
    with pytest.raises(nats.js.errors.BadRequestError, match="message size exceeds maximum"):
        await run.js.publish(run.names.rollouts_subject("s1"), body, headers={HDR_MSG_ID: "inline"}, timeout=30)
    for i in range(40):
        part = await run.js.publish(run.names.bodies_subject("s1"), body, headers={HDR_MSG_ID: f"g{i}-0"}, timeout=30)
        await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={
            HDR_MSG_ID: f"g{i}", HDR_BODY_PARTS: str(part.seq), HDR_BODY_SIZE: str(len(body)),
            HDR_BODY_SHA256: hashlib.sha256(body).hexdigest()})
    got: set[int] = set()
    async with asyncio.timeout(60):  # a tenth of ack_wait: the lost batch of a dropped connection never comes
        while len(got) < 40:
            for delivery in await inbox.fetch(64, timeout=5.0):
                assert await rollout_body(run.js, run.names, delivery.msg) == body
                got.add(delivery.seq)
    assert run.nc.stats["reconnects"] == 0


@pytest.mark.parametrize("groups_per_step", [4, 64])
async def test_a_fetch_lost_with_the_connection_comes_back_at_once_and_old_deliveries_are_not_acked(
        nats_server, runs, groups_per_step):
    """A dropped connection (here a broker restart) loses what was in flight with it: the lost
    batch came back only after ack_wait (600 s), and the acks of deliveries made before a restart
    went unanswered, three attempts of a second each, one message after another (17.6 s of
    recovery at 4 groups a step, 101.9 s at 32). The inbox resets its consumer on each new
    connection: every unacked message is offered again at once, and deliveries from before are
    not acked, whatever the step's size."""
    run = await runs.open("dropped")
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    for i in range(2 * groups_per_step):
        await run.js.publish(run.names.rollouts_subject("s1"), b"x", headers={HDR_MSG_ID: f"g{i}"})
    while len(inbox.held) < groups_per_step:  # a step's groups, held when the broker goes
        await inbox.fetch(groups_per_step - len(inbox.held), timeout=5.0)
    nats_server.stop()
    nats_server.start()
    again: set[int] = set()
    async with asyncio.timeout(60):  # a tenth of ack_wait
        while len(again) < 2 * groups_per_step:
            again.update(d.seq for d in await inbox.fetch(2 * groups_per_step, timeout=1.0) if d.connection > 0)
    assert again == set(range(1, 2 * groups_per_step + 1))
    attempts = []
    for delivery in inbox.held:
        delivery.msg.ack_sync = lambda timeout, d=delivery, ack=delivery.msg.ack_sync: attempts.append(d) or ack(timeout)
    assert await inbox.ack_held() == groups_per_step  # the first deliveries: left to the reset, not tried
    assert all(d.connection > 0 for d in attempts) and len(attempts) == 2 * groups_per_step
    assert (await inbox.counts()).pending == 0


async def test_a_fetch_returns_no_more_than_its_batch_whatever_the_subscription_queued(runs):
    """nats-py's fetch returns every message its subscription has queued, those of a pull request
    it gave up on included: a step was handed 6 groups for its 4 (seen in CI). The inbox hands
    out at most a fetch's batch and keeps the rest for the next fetch."""
    run = await runs.open("queued")
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    for i in range(6):
        await run.js.publish(run.names.rollouts_subject("s1"), b"x", headers={HDR_MSG_ID: f"g{i}"})
    pull = inbox.subscription._sub  # a pull request for 6 whose client stopped waiting: they queue up
    await run.nc.publish(inbox.subscription._nms, json.dumps({"batch": 6, "no_wait": True}).encode(),
                         inbox.subscription._deliver)
    async with asyncio.timeout(10):
        while pull._pending_queue.qsize() < 6:
            await asyncio.sleep(0.01)
    assert [d.seq for d in await inbox.fetch(4, timeout=1.0)] == [1, 2, 3, 4]
    assert [d.seq for d in await inbox.fetch(4, timeout=1.0)] == [5, 6]
    assert await inbox.ack_held() == 0 and (await inbox.counts()).pending == 0
