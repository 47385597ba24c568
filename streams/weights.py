"""Policy weights on the wire: each version is one or more safetensors objects in the run's
weights bucket (a LoRA adapter, or a full model's shards), announced on the weights subject (a
last-value stream, so late joiners catch up)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import safetensors.torch
import structlog
import torch
from nats.js.errors import APIError, NotFoundError

from echo.config import ConfigError
from echo.process.logs import Progress
from echo.weights import delta
from echo.weights.digest import tensors_digest
from echo.weights.retention import expired_versions
from echo.weights.shards import shards_tensors
from echo.wire.codec import encode
from echo.wire.messages import WeightsAnnouncement, WeightsLink, WeightsShard
from echo.wire.names import OBJ_HDR_TERM, OBJ_HDR_VERSION, Version, weights_object_name
from streams.client import BROKER_ERRORS, STORAGE_FULL, RunClient, cancel_until_done, publish_once
from streams.lease import Lease, current_term
from streams.objects import TransferError, get_object, put_object, sha256_hex
from streams.watch import LatestValue

log = structlog.get_logger()

OBJECT_WAIT_S = 30.0  # how long an announced object may take to reach this server before it counts as missing
NOT_YET_MIRRORED_S = 0.05  # how often to look for it meanwhile
LARGE_MB = 64  # a fetch this large shows its progress on a terminal (full weights; an adapter is quick)
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 15.0  # backoff between fetches of the newest version that failed


class WeightsPublisher:
    """The trainer's side of the weights, made from its lease (streams/lease.py), so only the
    run's current trainer can hold one: every announcement names the lease's term, and the
    publisher keeps the register of when each version it published was superseded, which
    retention decides on (echo/weights/retention.py). A version leaves the bucket once `keep` newer ones
    exist and a newer one was announced `keep_seconds` ago, so disk use is bounded and a fetch
    that takes less than that finishes."""

    def __init__(self, lease: Lease, keep: int = 3, keep_seconds: float = 0.0):
        self.lease, self.run, self.term, self.keep, self.keep_seconds = lease, lease.run, lease.term, keep, keep_seconds
        self.superseded_at: dict[int, float] | None = None  # version -> when a newer one came (inf: newest)
        self.chain: list[WeightsLink] = []  # this term's last whole version and the deltas after it

    @property
    def newest(self) -> WeightsLink | None:
        """The last version announced (a delta's base), None before the first."""
        return self.chain[-1] if self.chain else None

    async def publish(self, version: int, shards: Iterable[bytes], base_model: str,
                      kind: Literal["lora", "full"] = "lora", digest: str = "",
                      delta_of: int | None = None) -> WeightsAnnouncement:
        """Store every shard, then announce them: a sampler never hears of an object not yet
        complete. Then delete what retention lets go. With `delta_of` (the newest version), the
        shards are deltas against it, announced with the chain back to the last whole version."""
        run, stored = self.run, []
        before = [link for link in self.chain if link.version < version]  # a retried publish replaces its own
        if delta_of is not None and (not before or before[-1].version != delta_of):
            raise ValueError(f"a delta against version {delta_of}, not the last announced before {version}")
        for index, data in enumerate(shards):
            name = weights_object_name(self.term, version, index)
            try:
                info = await put_object(run.js, run.names.weights_bucket, name, data,
                                        headers={OBJ_HDR_VERSION: [str(version)], OBJ_HDR_TERM: [str(self.term)]})
            except APIError as e:  # no room: trying again would wait forever, for nothing frees any
                if e.err_code not in STORAGE_FULL:
                    raise
                raise ConfigError(
                    f"the broker refused version {version}'s weights ({e.description}): the weights kept "
                    f"(trainer.keep_versions, and every version newer than trainer.keep_versions_s) need room beside "
                    f"the two rollout streams' nats.rollouts_max_gb; raise `secure init --run-storage-gb` (or the "
                    f"broker's max_file_store), or lower those") from None
            stored.append(WeightsShard(object_name=name, size=len(data), sha256=sha256_hex(info)))  # hashed while sent
        announcement = WeightsAnnouncement(
            version=version, term=self.term, kind=kind, shards=stored, base_model=base_model, created_at=time.time(),
            digest=digest, delta_of=delta_of, chain=before if delta_of is not None else [],
        )
        await self.lease.held()  # never announced by a trainer that may have been taken over
        await publish_once(run, run.names.weights_subject, encode(announcement))
        self.chain = announcement.links
        await self._retire(version, time.time())
        return announcement

    async def _retire(self, version: int, now: float) -> None:
        kept = self.superseded_at
        if kept is None:  # the first publish: whatever earlier trainers left goes; what stays counts from now
            await self._delete_versions_before(version - self.keep + 1)
            kept = self.superseded_at = {v: now for v in range(max(version - self.keep + 1, 0), version)}
        for older, at in kept.items():
            if older < version and at == math.inf:
                kept[older] = now
        kept.setdefault(version, math.inf)  # a retried publish of this version is still the newest
        needed = frozenset(link.version for link in self.chain)
        for old in expired_versions(kept, version, self.keep, self.keep_seconds, now, needed):
            await self._delete_version(old)
            del kept[old]

    async def _delete_version(self, version: int) -> None:
        """Delete this term's shards of `version` by name (0, 1, ... until one is missing):
        no scan of the bucket, whose delete markers grow with the run."""
        for index in itertools.count():
            try:
                await self.run.weights.delete(weights_object_name(self.term, version, index))
            except NotFoundError:  # missing, or deleted already
                return

    async def _delete_versions_before(self, oldest_kept: int) -> None:
        """Delete every stored version older than `oldest_kept`, and every earlier term's."""
        try:
            infos = await self.run.weights.list(ignore_deletes=True)
        except NotFoundError:  # nats-py's name for an empty bucket
            return
        for info in infos:
            headers = info.headers or {}
            if OBJ_HDR_VERSION not in headers:
                continue  # not weights: a dataset's prompts (streams/prompts.py)
            version = int((headers.get(OBJ_HDR_VERSION) or ["-1"])[0])
            term = int((headers.get(OBJ_HDR_TERM) or ["-1"])[0])
            if 0 <= version < oldest_kept or term != self.term:
                await self.run.weights.delete(info.name)


async def fetch_weights(run: RunClient, announcement: WeightsAnnouncement | WeightsLink) -> list[bytearray]:
    """The announced shards' bytes, each checked against the announcement's size and digest as
    well as the object's own info; TransferError (not found, truncated, mismatch) otherwise."""
    shards = []
    total_mb = sum(s.size for s in announcement.shards) / 2**20
    with Progress(f"weights v{announcement.version}", round(total_mb), " MiB", show=total_mb >= LARGE_MB) as progress:
        for shard in announcement.shards:
            shards.append(await get_object(run.local_js, run.names.weights_bucket, shard.object_name, shard.sha256,
                                           shard.size))
            progress.advance(round(shard.size / 2**20))
    return shards


async def rebuild(run: RunClient, announcement: WeightsAnnouncement, tensors: dict[str, torch.Tensor],
                  links: list[WeightsLink]) -> list[bytearray]:
    """The announced version's whole weights (one safetensors shard): `tensors` with each of
    `links`' deltas applied in turn, checked against the announcement's digest. DeltaError for
    a delta that does not apply or weights that do not make the digest: nothing is kept of them."""
    # A delta (a bit mask and the changed values) is at most the whole weights and an eighth: bound
    # by those held, never by a size an announcement names (a relay could name any).
    inflated_max = 2 * sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20)
    for link in links:
        for data in await fetch_weights(run, link):
            tensors = await asyncio.to_thread(_applied, tensors, bytes(data), inflated_max)
    return [await asyncio.to_thread(_whole_if, tensors, announcement)]


def _applied(tensors: dict[str, torch.Tensor], packed: bytes, inflated_max: int) -> dict[str, torch.Tensor]:
    return delta.apply(tensors, delta.unpack(packed, inflated_max))


def _whole_if(tensors: dict[str, torch.Tensor], announcement: WeightsAnnouncement) -> bytearray:
    """`tensors` as one safetensors shard, if they are the weights `announcement`'s digest names."""
    if tensors_digest(tensors) != announcement.digest:
        raise delta.DeltaError(f"version {announcement.version}'s rebuilt weights are not its digest")
    return bytearray(safetensors.torch.save(tensors))


class WeightsFollower:
    """Keeps the newest announced weights downloaded and verified, ready for the sampler to
    apply between generations. Intermediate versions that were superseded are skipped."""

    def __init__(self, run: RunClient, base_model: str):
        self.run = run
        self.base_model = base_model
        self.failures: Counter[str] = Counter()
        self.ready: tuple[WeightsAnnouncement, list[bytearray]] | None = None
        self._ready_changed = asyncio.Condition()
        self._announcements = LatestValue(
            run.local_js, run.names.control_stream, run.names.weights_subject, WeightsAnnouncement, self._on_bad
        )
        self._task: asyncio.Task | None = None
        self.failed: BaseException | None = None  # why the fetch loop ended, if it did
        self.fetch_s: dict[tuple[int, int], float] = {}  # (term, version) -> from hearing of it to downloaded

    def _on_bad(self, error) -> None:
        self.failures[error.reason] += 1
        log.warning("weights.bad_announcement", reason=str(error))

    async def start(self) -> "WeightsFollower":
        await self._announcements.start()
        self._task = asyncio.create_task(self._fetch_loop())
        self._task.add_done_callback(self._on_fetch_loop_end)
        return self

    def _on_fetch_loop_end(self, task: asyncio.Task) -> None:
        """The fetch loop never returns: an end other than stop() is a failure, and whoever
        waits for weights hears of it (a sampler frozen on old weights must not look alive)."""
        if task.cancelled():
            return
        self.failed = task.exception()
        log.error("weights.follower_failed", reason=repr(self.failed))
        self._wake = asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._ready_changed:
            self._ready_changed.notify_all()

    async def _fetch_loop(self) -> None:
        handled = 0
        while True:
            seq, announcement = await self._announcements.wait_newer(handled)
            try:
                await self._take(announcement, seq)
            except BROKER_ERRORS as e:  # reading the term: the broker
                log.warning("weights.follow_failed", version=announcement.version, reason=repr(e))
                await asyncio.sleep(RETRY_FIRST_S)
                continue
            handled = seq

    async def _take(self, announcement: WeightsAnnouncement, seq: int) -> None:
        started = time.perf_counter()
        if self.ready and self.ready[0].term_version >= announcement.term_version:
            return
        if announcement.term != await current_term(self.run):
            self.failures["wrong_term"] += 1  # not from the trainer that holds the run
            log.warning("weights.refused", version=announcement.version, term=announcement.term)
            return
        if announcement.base_model != self.base_model:  # trained on another base: never generated on here
            self.failures["wrong_base_model"] += 1
            log.error("weights.wrong_base_model", version=announcement.version, announced=announcement.base_model,
                      ours=self.base_model)
            return
        data = await self._fetch_while_newest(announcement, seq)
        if data is None:
            return
        self.fetch_s = {announcement.term_version: time.perf_counter() - started}  # the ready version's
        seconds = self.fetch_s[announcement.term_version]
        log.debug("weights.fetched", version=announcement.version, seconds=round(seconds, 3))
        async with self._ready_changed:
            self.ready = (announcement, data)
            self._ready_changed.notify_all()

    async def _fetch_while_newest(self, announcement: WeightsAnnouncement, seq: int) -> list[bytearray] | None:
        """The announced shards, trying again with backoff while the announcement is the newest
        (a timeout, a damaged or purged object, a broker restart: in sequential mode a sampler
        that gave up would wait for this version forever). None once a newer one arrives.
        Through a relay an announcement can arrive before the mirror has the object: that
        wait (up to OBJECT_WAIT_S) is expected, not counted as a failure."""
        delay, mirror_deadline = RETRY_FIRST_S, time.monotonic() + OBJECT_WAIT_S
        while self._announcements.seq == seq:
            try:
                return await self._fetch_version(announcement)
            except TransferError as e:
                if e.reason == "not_found" and time.monotonic() < mirror_deadline:
                    await self._sleep_unless_superseded(NOT_YET_MIRRORED_S, seq)
                    continue
                reason, detail = e.reason, str(e)
            except BROKER_ERRORS as e:  # the broker, not the object
                reason, detail = "unreachable", repr(e)
            self.failures[reason] += 1
            log.warning("weights.fetch_failed", version=announcement.version, reason=detail, retry_in_s=delay)
            await self._sleep_unless_superseded(delay, seq)
            delay = min(2 * delay, RETRY_MAX_S)
        return None

    async def _fetch_version(self, announcement: WeightsAnnouncement) -> list[bytearray]:
        """Its whole shards: as published, or (a delta) rebuilt from the weights held when they
        are in its chain, else from the chain's anchor. TransferError ("bad_delta") when neither
        makes the digest announced."""
        if announcement.delta_of is None:
            return await fetch_weights(self.run, announcement)
        links = delta.route(announcement, self.ready and self.ready[0])
        if links[0].delta_of is not None:  # from the weights held
            try:
                return await rebuild(self.run, announcement, shards_tensors(self.ready[1]), links)
            except delta.DeltaError as e:  # the weights held are not the chain's, or a delta not theirs: the anchor
                self.failures["delta_refused"] += 1
                log.warning("weights.delta_refused", version=announcement.version, reason=str(e))
            # A TransferError (a delta not yet at this relay's mirror, a broker restart) is the
            # caller's to retry: the anchor would wait on the same delta.
        anchor, *chain = announcement.links
        try:
            return await rebuild(self.run, announcement, shards_tensors(await fetch_weights(self.run, anchor)), chain)
        except delta.DeltaError as e:
            raise TransferError("bad_delta", str(e)) from None

    async def _sleep_unless_superseded(self, seconds: float, seq: int) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._announcements.wait_newer(seq), seconds)

    async def _wait(self, ready) -> tuple[WeightsAnnouncement, list[bytearray]]:
        async with self._ready_changed:
            await self._ready_changed.wait_for(lambda: self.failed is not None or (self.ready and ready(self.ready[0])))
            if self.failed is not None:
                raise RuntimeError(f"the weights follower stopped: {self.failed!r}") from self.failed
            return self.ready

    async def wait_for(self, version: int, term: int | None = None) -> tuple[WeightsAnnouncement, list[bytearray]]:
        """Wait until weights of `version` or newer are downloaded (of `term` or a later one,
        when given: an earlier term's higher versions are older); return the newest."""
        if term is None:
            return await self._wait(lambda announcement: announcement.version >= version)
        return await self._wait(lambda announcement: announcement.term_version >= Version(term, version))

    async def wait_newer(self, than: Version) -> None:
        """Wait until weights of a version after `than` are downloaded."""
        await self._wait(lambda announcement: announcement.term_version > than)

    async def stop(self) -> None:
        """Stop fetching and following, and wait until both have ended (the connection may close
        next). Shielded: where this stop was itself cancelled (a teardown's cancel_until_done
        cancels again), a cancellation nats-py swallowed was not repeated, and the following was
        left polling a closed connection."""
        await asyncio.shield(cancel_until_done([t for t in (self._task, self._announcements.task) if t is not None]))
