"""The scheduler's choice on the wire: one key in the run's state bucket, written by the trainer's
coordinator and followed by every sampler (a standby sampler takes no slots)."""

from __future__ import annotations

from typing import Callable

from echo.wire.codec import decode, encode
from echo.wire.messages import Schedule
from echo.wire.names import SCHEDULE_KEY
from streams.client import RunClient
from streams.watch import RARELY_S, watch_forever


async def publish_schedule(run: RunClient, schedule: Schedule) -> None:
    await run.state.put(SCHEDULE_KEY, encode(schedule))


async def watch_schedule(run: RunClient, on_change: Callable[[Schedule], None]) -> None:
    """Forever: call `on_change` with the schedule, the current one first, then each new one."""
    await watch_forever(run, SCHEDULE_KEY, lambda value: on_change(decode(Schedule, value)), RARELY_S)
