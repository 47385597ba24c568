"""Connecting to NATS and opening (idempotently creating) everything a run owns."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from echo.protocol import ProtocolError, RunNames, decode

M = TypeVar("M")


async def connect(url: str, name: str) -> NATS:
    # Reconnect forever: a sampler on a flaky link should wait out a broker restart, not die.
    return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5)


@dataclass
class Run:
    nc: NATS
    js: JetStreamContext
    names: RunNames
    weights: ObjectStore
    state: KeyValue
    claims: KeyValue

    async def close(self) -> None:
        # Every publish here is awaited for its ack already, so there is nothing to drain.
        await self.nc.close()


async def open_run(url: str, run_id: str, client_name: str) -> Run:
    """Connect and create the run's streams and buckets. Both sides call this: creation with an
    identical config is a no-op, so neither has to start first."""
    names = RunNames(run_id)
    nc = await connect(url, client_name)
    js = nc.jetstream()
    await js.add_stream(names.rollouts_stream_config())
    await js.add_stream(names.control_stream_config())
    # nats-py overwrites config.bucket with the positional name: pass both.
    weights = await js.create_object_store(names.weights_bucket, config=names.weights_bucket_config())
    state = await js.create_key_value(config=names.state_bucket_config())
    claims = await js.create_key_value(config=names.claims_bucket_config())
    return Run(nc, js, names, weights, state, claims)


class LatestValue(Generic[M]):
    """Follows one subject of the last-value control stream and holds its newest message.

    Starting at the last message per subject means a late joiner reads the current value at
    once; afterwards every new one arrives as it is published."""

    def __init__(self, js: JetStreamContext, subject: str, cls: type[M], on_error: Callable[[ProtocolError], None]):
        self.js, self.subject, self.cls, self.on_error = js, subject, cls, on_error
        self.value: M | None = None
        self.seq = 0  # stream sequence of `value`: orders messages of any kind
        self._changed = asyncio.Condition()
        self._sub = None

    async def start(self) -> "LatestValue[M]":
        self._sub = await self.js.subscribe(
            self.subject, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, cb=self._on_msg
        )
        return self

    async def _on_msg(self, msg) -> None:
        try:
            value = decode(self.cls, msg.data)
        except ProtocolError as e:
            self.on_error(e)
            return
        async with self._changed:
            self.value, self.seq = value, msg.metadata.sequence.stream
            self._changed.notify_all()

    async def wait_newer(self, seq: int) -> tuple[int, M]:
        """Wait for a message later than stream sequence `seq`; return (its sequence, it)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.seq > seq)
            return self.seq, self.value

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
