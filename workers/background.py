"""Background tasks beside a worker's main loop (heartbeats, lease renewal, watches), supervised.

A task that dies silently leaves a process that looks alive and does nothing: a sampler that
heartbeats while frozen on old weights, a trainer whose held messages get redelivered. Here the
first task to fail cancels the main loop and its error is raised from the `async with` block, so
the process exits non-zero and compose or systemd restarts it. Errors worth retrying (a broker
restarting) are the task's own business: it catches those and tries again."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from streams.client import cancel_until_done


class Background:
    """`async with Background() as background: background.start(loop()); await main()`.
    Leaving the block cancels the tasks."""

    def __init__(self):
        self._group = asyncio.TaskGroup()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Background":
        await self._group.__aenter__()
        return self

    def start(self, coro: Coroutine) -> None:
        self._tasks.append(self._group.create_task(coro))

    async def __aexit__(self, *exc_info) -> bool | None:
        await cancel_until_done(self._tasks)
        try:
            return await self._group.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:  # the usual case: raise it as itself, not wrapped
                raise group.exceptions[0] from None
            raise
