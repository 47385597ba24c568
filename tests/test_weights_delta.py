"""Full weights sent as deltas against a real nats-server: the trainer's side
(echo/train/checkpoint.py's files, streams/weights.py's publisher) and a sampler's follower, which
rebuilds each version bit for bit from the weights it holds or from the chain's anchor, and
refuses whatever does not make the digest announced."""

import asyncio
import hashlib
import time
import tracemalloc
import zlib

import pytest
import safetensors.torch
import torch

from echo.weights import delta
from echo.weights.digest import files_digest, tensors_digest
from echo.weights.files import delta_shards, weights_at, weights_file
from echo.weights.shards import shards_tensors
from echo.wire.codec import encode
from echo.wire.messages import WeightsAnnouncement, WeightsLink, WeightsShard
from echo.wire.names import weights_object_name
from streams.client import publish_once
from streams.lease import take_lease
from streams.objects import put_object
from streams.weights import WeightsFollower, WeightsPublisher
from tests.conftest import TINY_BASE, eventually_async

SHARDS = [("embed", (64, 32)), ("head", (31, 15))]  # one tensor a shard; head's mask has 7 spare bits


def versions(n: int, changed: float = 0.05) -> list[dict[str, torch.Tensor]]:
    """`n` versions of bf16 weights, each changing about `changed` of the elements of the last."""
    gen = torch.Generator().manual_seed(0)
    weights = [{name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in SHARDS}]
    for _ in range(n - 1):
        step = {}
        for name, tensor in weights[-1].items():
            moved = torch.rand(tensor.shape, generator=gen) < changed
            step[name] = torch.where(moved, (tensor.float() * 1.5 + 0.1).to(torch.bfloat16), tensor)
        weights.append(step)
    return weights


def write(run_dir, version: int, tensors: dict[str, torch.Tensor]) -> list:
    """The version's shard files as the trainer writes them (workers/trainer/model.py)."""
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    for index, (name, _) in enumerate(SHARDS):
        weights_file(run_dir, version, index).write_bytes(safetensors.torch.save({name: tensors[name]}))
    return weights_at(run_dir, version)


async def publish(publisher: WeightsPublisher, run_dir, version: int, tensors, whole: bool = False, **lie):
    """What the trainer's publish_version does, a delta unless `whole` (or the first); `lie`
    replaces the digest or the deltas."""
    files = write(run_dir, version, tensors)
    base = publisher.newest
    if whole or base is None:
        return await publisher.publish(version, [f.read_bytes() for f in files], TINY_BASE, "full",
                                       digest=lie.get("digest", files_digest(files)))
    deltas = lie.get("deltas") or delta_shards(weights_at(run_dir, base.version), files, max_bytes=1 << 30)
    return await publisher.publish(version, deltas, TINY_BASE, "full", digest=lie.get("digest", files_digest(files)),
                                   delta_of=base.version)


def held(follower: WeightsFollower) -> dict[str, torch.Tensor]:
    return shards_tensors(follower.ready[1])


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return tensors_digest(a) == tensors_digest(b)


async def test_a_follower_rebuilds_each_delta_bit_for_bit_and_a_late_one_from_the_anchor(runs, tmp_path):
    run = await runs.open("d", "trainer")
    publisher = WeightsPublisher(await take_lease(run), keep=1)
    weights = versions(6)
    follower = await WeightsFollower(await runs.open("d", "early"), TINY_BASE).start()
    announcements = []
    for version, tensors in enumerate(weights[:5]):
        announcements.append(await publish(publisher, tmp_path, version, tensors))
        await follower.wait_for(version)
        assert same_bits(held(follower), tensors)
    assert [a.delta_of for a in announcements] == [None, 0, 1, 2, 3]
    assert all(a.size < announcements[0].size / 3 for a in announcements[1:])  # 5% changed: a fraction of the whole
    late = await WeightsFollower(await runs.open("d", "late"), TINY_BASE).start()
    await late.wait_for(4)  # from the anchor, version 0, and the four deltas after it
    assert same_bits(held(late), weights[4])
    assert follower.failures == late.failures == {}

    # The bucket keeps the chain the newest version is built from, whatever `keep` says; a new
    # anchor lets it go.
    stored = {info.name for info in await run.weights.list(ignore_deletes=True)}
    assert stored == {s.object_name for a in announcements for s in a.shards}
    anchor = await publish(publisher, tmp_path, 5, weights[5], whole=True)
    await follower.wait_for(5)
    assert same_bits(held(follower), weights[5])
    assert {info.name for info in await run.weights.list(ignore_deletes=True)} == {s.object_name for s in anchor.shards}
    await follower.stop()
    await late.stop()


def past_the_end(deltas: list[bytes]) -> list[bytes]:
    """The head's delta with a bit set past its tensor's 465 elements (one of its mask's spare
    bits), and a value for it."""
    tensors = delta.unpack(deltas[1], 1 << 20)
    tensors["head.changed"][-1] |= 0x01
    tensors["head.values"] = torch.cat([tensors["head.values"], tensors["head.values"][:1]])
    return [deltas[0], delta.pack(tensors)]


@pytest.mark.parametrize("lie", ["wrong digest", "bits past the end", "not a delta"])
async def test_a_delta_that_does_not_make_its_digest_is_refused_and_the_weights_held_kept(runs, tmp_path, lie):
    run = await runs.open("bad", "trainer")
    publisher = WeightsPublisher(await take_lease(run))
    weights = versions(3)
    follower = await WeightsFollower(await runs.open("bad", "sampler"), TINY_BASE).start()
    await publish(publisher, tmp_path, 0, weights[0])
    await follower.wait_for(0)
    honest = delta_shards(write(tmp_path, 0, weights[0]), write(tmp_path, 1, weights[1]), max_bytes=1 << 30)
    lies = {"wrong digest": {"digest": "f" * 64}, "bits past the end": {"deltas": past_the_end(honest)},
            "not a delta": {"deltas": [b"\x78\x9c junk", honest[1]]}}[lie]
    await publish(publisher, tmp_path, 1, weights[1], **lies)
    await eventually_async(lambda: "bad_delta" in follower.failures, 10)
    # Tried from the weights held, then from the anchor: neither makes version 1, so nothing changed.
    assert follower.failures["delta_refused"] >= 1 and follower.failures["bad_delta"] >= 1
    assert follower.ready[0].version == 0 and same_bits(held(follower), weights[0])
    await publish(publisher, tmp_path, 2, weights[2], whole=True)  # the trainer's next anchor is taken
    await follower.wait_for(2)
    assert same_bits(held(follower), weights[2])
    await follower.stop()


async def test_weights_held_that_are_not_the_chains_are_rebuilt_from_the_anchor(runs, tmp_path):
    run = await runs.open("drift", "trainer")
    publisher = WeightsPublisher(await take_lease(run))
    weights = versions(3)
    follower = await WeightsFollower(await runs.open("drift", "sampler"), TINY_BASE).start()
    for version in (0, 1):
        await publish(publisher, tmp_path, version, weights[version])
    await follower.wait_for(1)
    follower.ready[1][0][-1] ^= 0x01  # the held weights damaged since they were checked (a bit flip)
    await publish(publisher, tmp_path, 2, weights[2])
    await follower.wait_for(2)
    assert same_bits(held(follower), weights[2])
    assert follower.failures == {"delta_refused": 1}
    await follower.stop()


def test_a_delta_is_given_up_once_its_changed_values_pass_the_share_allowed(tmp_path):
    """Weights published in fp32 change in nearly every element each step: the trainer stops
    encoding as soon as the values alone would pass delta_max_share, and packs nothing."""
    old, new = versions(2, changed=0.05)
    files = [write(tmp_path / "a", 0, old), write(tmp_path / "a", 1, new)]
    whole = sum(f.stat().st_size for f in files[1])
    assert delta_shards(*files, max_bytes=0.5 * whole) is not None  # 5% changed: ~10% of the whole once packed
    moved = {name: (t.float() + 1).to(torch.bfloat16) for name, t in old.items()}
    files = [write(tmp_path / "b", 0, old), write(tmp_path / "b", 1, moved)]
    assert delta_shards(*files, max_bytes=0.5 * whole) is None


async def test_a_delta_announced_before_its_objects_arrive_is_waited_for_not_refused(runs, tmp_path):
    """Through a relay the announcement can arrive before the mirror has the delta's objects:
    the follower waits for them (as for a whole version), and neither refuses the delta nor
    fetches the anchor meanwhile."""
    run = await runs.open("early", "trainer")
    publisher = WeightsPublisher(await take_lease(run))
    weights = versions(2)
    follower = await WeightsFollower(await runs.open("early", "sampler"), TINY_BASE).start()
    base = await publish(publisher, tmp_path, 0, weights[0])
    await follower.wait_for(0)
    files = write(tmp_path, 1, weights[1])
    deltas = delta_shards(weights_at(tmp_path, 0), files, max_bytes=1 << 30)
    names = [weights_object_name(publisher.term, 1, i) for i in range(len(deltas))]
    shards = [WeightsShard(object_name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
              for name, data in zip(names, deltas)]
    announcement = WeightsAnnouncement(version=1, term=publisher.term, kind="full", shards=shards,
                                       base_model=TINY_BASE, created_at=0.0, digest=files_digest(files), delta_of=0,
                                       chain=base.links)
    await run.js.publish(run.names.weights_subject, encode(announcement))
    await asyncio.sleep(0.5)
    for name, data in zip(names, deltas):
        await put_object(run.js, run.names.weights_bucket, name, data)
    await follower.wait_for(1)
    assert same_bits(held(follower), weights[1]) and follower.failures == {}
    await follower.stop()


async def test_a_delta_bomb_inflates_no_further_than_the_weights_held(runs, tmp_path):
    """A delta bomb: on the route from weights held, the inflate bound came from the anchor's size
    as the announcement names it, never checked there: 2 MB packed inflated to 2 GiB before the
    refusal. The bound is now twice the weights held, whatever an announcement (a relay's) says."""
    run = await runs.open("bomb", "trainer")
    publisher = WeightsPublisher(await take_lease(run))
    follower = await WeightsFollower(await runs.open("bomb", "sampler"), TINY_BASE).start()
    anchor = await publish(publisher, tmp_path, 0, versions(1)[0])
    await follower.wait_for(0)
    bomb = zlib.compress(bytes(96 << 20), 9)  # ~100 KB that inflate to 96 MB
    shards = []
    for index in range(len(SHARDS)):
        name = weights_object_name(anchor.term, 1, index)
        await put_object(run.js, run.names.weights_bucket, name, bomb)
        shards.append(WeightsShard(object_name=name, size=len(bomb), sha256=hashlib.sha256(bomb).hexdigest()))
    claimed = [s.model_copy(update={"size": 1 << 30}) for s in anchor.shards]  # the anchor "is" 2 GiB
    forged = WeightsAnnouncement(version=1, term=anchor.term, kind="full", shards=shards, base_model=TINY_BASE,
                                 created_at=time.time(), digest="f" * 64, delta_of=0,
                                 chain=[WeightsLink(version=0, shards=claimed, digest=anchor.digest)])
    tracemalloc.start()
    try:
        await publish_once(run, run.names.weights_subject, encode(forged))
        await eventually_async(lambda: "delta_refused" in follower.failures, 10)
        assert follower.failures["delta_refused"] >= 1
        assert tracemalloc.get_traced_memory()[1] < 32 << 20  # peak: not the 96 MB, let alone 2 GiB
    finally:
        tracemalloc.stop()
    assert follower.ready[0].version == 0  # the weights held are kept
    await follower.stop()
