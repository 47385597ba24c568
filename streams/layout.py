"""The run's streams and buckets on the broker, as nats-py configs: what the trainer creates and
a relay mirrors, under the names echo/wire/names.py's RunNames gives them."""

from __future__ import annotations

from nats.js.api import (
    DiscardPolicy,
    ExternalStream,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)

from echo.wire.names import (
    BODY_PART_MAX,
    ROLLOUT_DEDUP_WINDOW_S,
    ROLLOUT_MESSAGE_MAX,
    STATUS_MAX_BYTES,
    RunNames,
    Storage,
)


def rollouts_stream(names: RunNames, storage: Storage = Storage()) -> StreamConfig:
    # Limits retention (not work-queue): acked rollouts stay, so a run can be replayed, up to
    # the storage's limits (the oldest go first).
    return _history_stream(names.rollouts_stream, names.all_rollouts, storage, ROLLOUT_MESSAGE_MAX)


def bodies_stream(names: RunNames, storage: Storage = Storage()) -> StreamConfig:
    # Kept like the rollouts that point to them, so a replay can read large groups too.
    return _history_stream(names.bodies_stream, names.all_bodies, storage, BODY_PART_MAX)


def control_stream(names: RunNames, storage: Storage = Storage()) -> StreamConfig:
    # A last-value stream: it holds only the newest weights announcement and the newest pull
    # request, so a sampler that joins late reads the current state at once.
    return StreamConfig(
        name=names.control_stream,
        subjects=[names.weights_subject, names.pull_subject],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=1,
        allow_direct=True,  # read by direct gets (streams/client.py LatestValue)
        num_replicas=storage.replicas,
    )


def weights_bucket(names: RunNames, storage: Storage = Storage()) -> ObjectStoreConfig:
    return ObjectStoreConfig(bucket=names.weights_bucket, storage=StorageType.FILE, replicas=storage.replicas)


def state_bucket(names: RunNames, storage: Storage = Storage()) -> KeyValueConfig:
    # Read by direct gets (streams/client.py watch_forever).
    return KeyValueConfig(bucket=names.state_bucket, storage=StorageType.FILE, replicas=storage.replicas, direct=True)


def registry_stream(names: RunNames, storage: Storage = Storage()) -> StreamConfig:
    """The samplers' heartbeat bucket as its stream: a KV bucket whose writes (each sampler its
    own key) can roll nothing up, and no one may purge or delete from (a `Nats-Rollup: all` on a
    sampler's own key of the state bucket wiped the trainer's lease, config and slot count).
    Keys expire by their TTL (put_expiring)."""
    return StreamConfig(
        name=f"KV_{names.registry_bucket}",
        subjects=[f"$KV.{names.registry_bucket}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        allow_rollup_hdrs=False,
        deny_delete=True,
        deny_purge=True,
        allow_direct=True,
        allow_msg_ttl=True,
        max_msg_size=STATUS_MAX_BYTES,  # refused by the broker: no reader decodes a larger one
        num_replicas=storage.replicas,
    )


def weights_mirrors(names: RunNames, upstream_domain: str) -> list[StreamConfig]:
    """A relay's copies of what samplers read about weights: the object store and the control
    stream (announcements), under the same names, so the same client code reads either (by
    direct gets)."""
    source = ExternalStream(api=f"$JS.{upstream_domain}.API")
    return [
        StreamConfig(name=name, storage=StorageType.FILE, mirror=StreamSource(name=name, external=source),
                     allow_direct=True, **limits)
        # The object store last: a sampler that finds it knows the relay is complete.
        for name, limits in [(names.control_stream, {"max_msgs_per_subject": 1}), (names.weights_stream, {})]
    ]


def _history_stream(name: str, subjects: str, storage: Storage, message_max: int) -> StreamConfig:
    # What samplers write: no message of theirs may roll the stream up, and no one purges or
    # deletes from it (its retention limits alone remove messages). Each sampler writes one
    # subject: the per-subject limit, in messages of at most `message_max`, is its byte quota, and
    # past it only its own oldest messages go (NATS has no per-subject byte limit).
    per_sampler = max(1, storage.sampler_max_bytes // message_max) if storage.sampler_max_bytes > 0 else -1
    return StreamConfig(
        name=name,
        subjects=[subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=ROLLOUT_DEDUP_WINDOW_S,
        max_bytes=storage.rollouts_max_bytes,
        max_age=storage.rollouts_max_age_s,
        max_msg_size=message_max,
        max_msgs_per_subject=per_sampler,
        num_replicas=storage.replicas,
        allow_rollup_hdrs=False,
        deny_delete=True,
        deny_purge=True,
    )
