"""Asking the trainer for work. The trainer grants slots (streams/grants.py) under its grant
budget (async mode) or a pull request (sequential mode); the scheduler may put the sampler on
standby (streams/schedule.py), when it keeps its weights current and asks for nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import structlog

from echo.fleet.grants import IDLE_ASK_MIN_S, ask_share, drawn_to_ask
from echo.wire.messages import Grant, GrantBudget, GrantRequest, PullRequest, Schedule
from echo.wire.names import Version
from streams.client import RunClient
from streams.grants import request_grant

log = structlog.get_logger()

IDLE_WAIT_MAX_S = 120.0  # the longest wait for a budget heeded, whatever a grant says


class Work:
    def __init__(self, run: RunClient, sampler_id: str, prompts_per_call: int, process: str):
        self.run, self.sampler_id, self.prompts_per_call = run, sampler_id, prompts_per_call
        self.process = process  # this process's random name (Sampler), in every request
        self.standby = False  # the scheduler's choice: keep the weights current, take no work
        self.changed = asyncio.Event()  # async mode: the budget or the standby changed, so an idle sampler asks again
        # Async mode: the version of the newest budget, where it drew this sampler to ask, until it
        # asks running that version (with older weights it would be granted nothing).
        self.drawn: int | None = None
        self.wait_version = 0  # async mode: no budget of an older version wakes it (Grant.wait_version)
        # Async mode: granted nothing, it waits idle_for_s for a budget or weights, then asks anyway
        # at ask_by, which nothing that wakes it meanwhile moves.
        self.idle_for_s, self.ask_by = idle_s(None), 0.0
        self.pull_request: PullRequest | None = None  # sequential mode: the newest request it has read
        self.unanswered = 0  # requests for work no trainer answered (none serving yet, a broker restarting)
        self.claimed_s_per_token: float | None = None  # async mode: its warm-up's pace (Generation.warm_up)

    async def ask(self, running: Version, pull_request_id: str | None = None) -> Grant | None:
        """What the trainer grants this sampler to generate with the weights it runs (None: no
        answer came)."""
        request = GrantRequest(want=self.prompts_per_call, term=running.term, version=running.version,
                               pull_request_id=pull_request_id, process=self.process,
                               claimed_s_per_token=self.claimed_s_per_token)
        grant = await request_grant(self.run, self.sampler_id, request)
        self.answered(grant)
        if self.drawn is not None and running.version >= self.drawn:
            self.drawn = None
        self.unanswered += grant is None
        return grant

    def answered(self, grant: Grant | None) -> None:
        if grant is not None:
            self.wait_version = grant.wait_version
        self.idle_for_s = idle_s(grant)
        self.ask_by = time.monotonic() + self.idle_for_s

    async def idle(self, newer_weights: Awaitable) -> bool:
        """Wait until the budget or the standby changes or `newer_weights` come; True where none
        did by ask_by, when it asks anyway. A wake that draws it to no ask does not put that off:
        a refused sampler, waiting for the next version, was woken by each redraw of its own
        (every REDRAW_S) and never asked again, and where the sampler that took the work then
        froze, the run stalled for good (CI, 2026-12-06)."""
        now = time.monotonic()
        if self.ask_by <= now:  # it did not ask (on standby): the wait starts over
            self.ask_by = now + self.idle_for_s
        waits = [asyncio.ensure_future(self.changed.wait()), asyncio.ensure_future(newer_weights)]
        done, pending = await asyncio.wait(waits, timeout=self.ask_by - now, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return not done

    def follow_budget(self, budget: GrantBudget) -> None:
        """A new budget: this sampler asks for work if it is drawn to (among many idle ones, a
        share just large enough to take the open slots), of a version it does not wait past."""
        drawn = budget.version >= self.wait_version and \
            drawn_to_ask(self.sampler_id, budget.version, budget.draw, ask_share(budget.open, budget.idle))
        self.drawn = budget.version if drawn else None
        self.changed.set()

    def follow_schedule(self, schedule: Schedule) -> None:
        standby = self.sampler_id in schedule.standby
        if standby != self.standby:
            log.info("sampler.standby" if standby else "sampler.active", why=schedule.why)
            self.standby = standby
            self.drawn = 0  # whatever it runs
            self.changed.set()  # an idle sampler asks for work at once


def idle_s(grant: Grant | None) -> float:
    """How long to wait for a new budget or weights, granted nothing with none left (or on
    standby, or unanswered), before asking anyway: as the trainer says (longer among many
    samplers), within IDLE_ASK_MIN_S and IDLE_WAIT_MAX_S."""
    return min(max(grant.again_s if grant else 0.0, IDLE_ASK_MIN_S), IDLE_WAIT_MAX_S)
