"""Quarantined samplers on the wire: one key in the run's state bucket, changed with
compare-and-set by the trainer (catching a sampler) and by an operator (lifting it)."""

from __future__ import annotations

import functools
from typing import Callable

from nats.js.errors import KeyWrongLastSequenceError

from echo.wire.codec import decode, encode
from echo.wire.messages import Quarantine
from echo.wire.names import QUARANTINE_KEY
from streams.client import Run
from streams.watch import read_value, watch_forever


async def _read(run: Run) -> tuple[Quarantine, int]:
    quarantine, revision = await read_value(run.state, QUARANTINE_KEY, functools.partial(decode, Quarantine))
    return quarantine or Quarantine(), revision


async def read_quarantine(run: Run) -> dict[str, str]:
    """Quarantined sampler ids and why."""
    return dict((await _read(run))[0].samplers)


async def change_quarantine(run: Run, change: Callable[[dict[str, str]], None]) -> dict[str, str]:
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


async def watch_quarantine(run: Run, on_change: Callable[[dict[str, str]], None]) -> None:
    """Forever: call `on_change` with the quarantined samplers whenever they change."""
    def changed(value: bytes) -> None:
        on_change(dict(decode(Quarantine, value).samplers))

    await watch_forever(run, QUARANTINE_KEY, changed)
