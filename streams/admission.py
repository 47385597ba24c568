"""The admission budget on the wire: the trainer's AdmissionBudget and the samplers' lease
counter, both in the run's state bucket. Taking leases is a compare-and-set on the counter."""

from __future__ import annotations

import asyncio

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from echo.admission import sampler_cap
from echo.protocol import BUDGET_KEY, LEASES_KEY, AdmissionBudget, decode, encode
from streams.client import Run


async def publish_budget(run: Run, budget: AdmissionBudget) -> None:
    await run.state.put(BUDGET_KEY, encode(budget))


async def watch_budget(run: Run, changed: asyncio.Event) -> None:
    """Set `changed` whenever the trainer publishes a budget, so idle samplers wait instead of
    polling the server."""
    async for _ in await run.state.watch(BUDGET_KEY):
        changed.set()


async def leases_taken(run: Run) -> tuple[int, int]:
    """(leases taken so far, the counter's revision; 0 if it does not exist yet)."""
    try:
        entry = await run.state.get(LEASES_KEY)
    except KeyNotFoundError:
        return 0, 0
    return int(entry.value), entry.revision


async def take_leases(run: Run, want: int, sampler_version: int) -> int:
    """Take up to `want` leases for groups generated with `sampler_version`; return how many."""
    try:
        budget = decode(AdmissionBudget, (await run.state.get(BUDGET_KEY)).value)
    except KeyNotFoundError:
        return 0  # no trainer yet: nothing may be generated
    cap = sampler_cap(budget.version, budget.allowance, sampler_version, budget.groups_per_step)
    while True:
        taken, revision = await leases_taken(run)
        grant = min(want, cap - taken)
        if grant <= 0:
            return 0
        value = str(taken + grant).encode()
        try:
            if revision == 0:
                await run.state.create(LEASES_KEY, value)
            else:
                await run.state.update(LEASES_KEY, value, last=revision)
            return grant
        except KeyWrongLastSequenceError:
            continue  # another sampler took leases in between: read again
