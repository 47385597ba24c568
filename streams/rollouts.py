"""Rollouts on the wire: samplers publish groups on their own subject of the durable rollout
stream; the trainer reads them through a durable pull consumer and acks each explicitly."""

from __future__ import annotations

import asyncio
import json

import structlog
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from echo.protocol import TRAINER_CONSUMER, RolloutGroup, encode_rollout, rollout_headers
from streams.client import BROKER_ERRORS, Run

log = structlog.get_logger()

PUBLISH_RETRY_MAX_S = 10.0


async def publish_rollout(run: Run, group: RolloutGroup) -> None:
    """Publish until the stream has it: through a broker restart or a relay's cut uplink (no
    responders), a sampler keeps its group and tries again with backoff, never dies of it."""
    subject = run.names.rollouts_subject(group.sampler_id)
    data, headers = encode_rollout(group), rollout_headers(group)
    delay = 0.5
    while True:
        try:
            # Nats-Msg-Id makes a retry safe: a publish can time out although it was stored.
            await run.js.publish(subject, data, headers=headers, timeout=10)
            return
        except (*BROKER_ERRORS, json.JSONDecodeError) as e:  # nats-py decodes a status-only reply as JSON
            log.warning("rollout.publish_failed", group=group.group_id, reason=repr(e), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, PUBLISH_RETRY_MAX_S)


async def trainer_subscription(run: Run, ack_wait_s: float = 600.0):
    """The trainer's durable pull consumer over all samplers' rollout subjects. Messages are
    acked after the step that used (or dropped) them; unacked ones come back after ack_wait."""
    config = ConsumerConfig(
        durable_name=TRAINER_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_ack_pending=-1,
        filter_subject=run.names.all_rollouts,
    )
    return await run.js.pull_subscribe(
        run.names.all_rollouts, durable=TRAINER_CONSUMER, stream=run.names.rollouts_stream, config=config
    )


async def fetch_rollouts(subscription, batch: int, timeout: float) -> list:
    """Up to `batch` messages, or [] when none arrived within `timeout`."""
    try:
        return await subscription.fetch(batch, timeout=timeout)
    except (NatsTimeout, asyncio.TimeoutError):
        return []
    except BROKER_ERRORS as e:  # a broker restarting, a cluster moving the consumer's leader
        log.warning("rollouts.fetch_failed", reason=repr(e))
        await asyncio.sleep(timeout)
        return []

