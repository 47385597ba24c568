"""Quarantined samplers on the wire: one key in the run's state bucket, changed with
compare-and-set by the trainer (catching a sampler) and by an operator (lifting it); and the
trainer's strikes and suspects beside it (read back by a restarted trainer, cleared by a lift)."""

from __future__ import annotations

import functools
from typing import Callable

from nats.js.errors import KeyWrongLastSequenceError

from echo.wire.codec import decode, encode
from echo.wire.messages import Quarantine, Strikes
from echo.wire.names import QUARANTINE_KEY, STRIKES_KEY
from streams.client import RunClient
from streams.watch import RARELY_S, read_value, watch_forever


async def _read(run: RunClient) -> tuple[Quarantine, int]:
    quarantine, revision = await read_value(run.state, QUARANTINE_KEY, functools.partial(decode, Quarantine))
    return quarantine or Quarantine(), revision


async def read_quarantine(run: RunClient) -> dict[str, str]:
    """Quarantined sampler ids and why."""
    return dict((await _read(run))[0].samplers)


async def change_quarantine(run: RunClient, change: Callable[[dict[str, str]], None]) -> dict[str, str]:
    """Apply `change` to the quarantined samplers, retrying if another writer came first."""
    while True:
        current, revision = await _read(run)
        samplers = dict(current.samplers)
        change(samplers)
        value = encode(Quarantine(samplers=samplers))
        try:
            if revision == 0:
                await run.state.create(QUARANTINE_KEY, value)
            else:
                await run.state.update(QUARANTINE_KEY, value, last=revision)
            return samplers
        except KeyWrongLastSequenceError:
            continue


async def watch_quarantine(run: RunClient, on_change: Callable[[dict[str, str]], None]) -> None:
    """Forever: call `on_change` with the quarantined samplers whenever they change."""
    def changed(value: bytes) -> None:
        on_change(dict(decode(Quarantine, value).samplers))

    await watch_forever(run, QUARANTINE_KEY, changed, RARELY_S)


async def read_strikes(run: RunClient) -> Strikes:
    """The strikes and suspects the run's trainers recorded (none before the first)."""
    return (await read_value(run.state, STRIKES_KEY, functools.partial(decode, Strikes)))[0] or Strikes()


async def put_strikes(run: RunClient, strikes: Strikes) -> None:
    """The trainer's record (it alone writes it, one trainer holding the lease at a time)."""
    await run.state.put(STRIKES_KEY, encode(strikes))


async def forgive(run: RunClient, sampler_id: str) -> None:
    """A lifted sampler's strikes and suspicion cleared: a fresh start, also for the next trainer."""
    strikes = await read_strikes(run)
    counts = {k: v for k, v in strikes.counts.items() if k != sampler_id}
    await put_strikes(run, Strikes(counts=counts, suspects=[s for s in strikes.suspects if s != sampler_id]))
