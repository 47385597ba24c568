"""The admission budget on the wire: the trainer's AdmissionBudget and its count of leases
granted so far, both in the run's state bucket and written by the trainer only."""

from __future__ import annotations

import asyncio

from nats.js.errors import KeyNotFoundError

from echo.protocol import BUDGET_KEY, LEASES_KEY, AdmissionBudget, encode
from streams.client import Run, watch_forever


async def publish_budget(run: Run, budget: AdmissionBudget) -> None:
    await run.state.put(BUDGET_KEY, encode(budget))


async def watch_budget(run: Run, changed: asyncio.Event) -> None:
    """Set `changed` whenever the trainer publishes a budget, so idle samplers ask for work
    again at once instead of polling the trainer."""
    await watch_forever(run, BUDGET_KEY, lambda _: changed.set())


async def leases_granted(run: Run) -> int:
    """Leases granted so far: a restarted trainer numbers its grants on from there."""
    try:
        return int((await run.state.get(LEASES_KEY)).value)
    except KeyNotFoundError:
        return 0


async def record_leases_granted(run: Run, granted: int) -> None:
    await run.state.put(LEASES_KEY, str(granted).encode())
