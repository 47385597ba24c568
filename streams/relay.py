"""A site relay's JetStream side: mirrors of a run's weights from upstream, and their upkeep.

The relay is a NATS leaf node with a JetStream domain of its own (streams/server.py). It keeps
mirrors of the weights object store and the control stream (announcements) under the
upstream's names, so a sampler connected to the relay reads weights with the same code as one
connected to the hub, and every byte crosses the uplink once per site. Relays chain: a
sub-site relay mirrors the site relay's mirrors (upstream domain = the site's domain).

A mirror copies messages but not purges: the hub deleting an old version leaves its chunks in
the mirror. `prune_replaced` follows the mirrored object metadata and purges the chunks of
objects deleted or replaced upstream, so a relay's disk use is bounded as the hub's is.
"""

from __future__ import annotations

import asyncio
import json

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, ObjectInfo

from echo.wire.names import RunNames
from streams.client import wait_for_jetstream
from streams.layout import weights_mirrors

log = structlog.get_logger()


async def open_mirrors(nc: NATS, names: RunNames, upstream_domain: str, timeout: float = 30.0) -> JetStreamContext:
    """Create the run's weight mirrors on the relay (idempotent: a restarted relay finds them in
    its store and the mirrors resume where they stopped). Waits until upstream answers, so a
    relay that cannot reach its hub says so instead of mirroring nothing."""
    js = nc.jetstream()
    await wait_for_jetstream(nc.jetstream(domain=upstream_domain), f"upstream domain {upstream_domain!r}", timeout)
    for config in weights_mirrors(names, upstream_domain):
        await js.add_stream(config)
    return js


async def prune_replaced(js: JetStreamContext, names: RunNames) -> None:
    """Forever: purge the mirrored chunks of every object deleted or replaced upstream."""
    live: dict[str, str] = {}  # object name -> nuid of its chunks
    meta_prefix = f"$O.{names.weights_bucket}.M."

    async def on_meta(msg) -> None:
        info = ObjectInfo.from_response(json.loads(msg.data))
        stale = {live.pop(info.name, None)}
        if info.deleted:
            stale.add(info.nuid)
        else:
            live[info.name] = info.nuid
            stale.discard(info.nuid)
        for nuid in stale - {None}:
            await js.purge_stream(names.weights_stream, subject=f"$O.{names.weights_bucket}.C.{nuid}")
            log.debug("relay.pruned", object=info.name, nuid=nuid)

    sub = await js.subscribe(
        meta_prefix + ">",
        stream=names.weights_stream,
        ordered_consumer=True,
        idle_heartbeat=1.0,
        deliver_policy=DeliverPolicy.ALL,
        cb=on_meta,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await sub.unsubscribe()
