"""The trainer's granter: how it asks the samplers for groups and grants them the work.

Owns the grants (numbered, answered on each sampler's grants subject while the trainer runs,
streams/grants.py), the count of grants lost and handed out again, and the choice between the
two modes: sequential mode's pull requests (each step asks for exactly its groups) and async
mode's grant budget (echo/fleet/grants.py). Its holders (workers/trainer/holders.py) release
the grants of dead or stalled samplers; it asks the quarantine (workers/trainer/strikes.py) and
honours the scheduler's standby set (workers/trainer/coordinator.py). It reads no rollouts: the
intake tells it, through the shared GrantLedger, which grants were fulfilled or wasted.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from echo.config import EchoConfig
from echo.fleet.grants import REDRAW_S, GrantLedger, allowance, ask_again_s, lost_slots, sampler_cap
from echo.train.checkpoint import TrainerState
from echo.wire.messages import Grant, GrantBudget, GrantRequest, PullRequest
from streams.client import BROKER_ERRORS, RunClient, retry_forever
from streams.grants import publish_budget, record_slots_granted, serve_grants, slots_granted
from streams.pull import publish_pull_request
from streams.registry import heartbeat_unreadable
from workers.trainer.holders import Holders
from workers.trainer.strikes import Quarantined

log = structlog.get_logger()


class Granter:
    """How the trainer asks the samplers for groups and grants them the work (numbered slots,
    streams/grants.py, answered while it runs), and hands out again the work of slots lost:
    groups that arrived and were not trained, and the slots its holders released (a sampler
    gone or stalled: workers/trainer/holders.py)."""

    def __init__(self, run: RunClient, term: int, cfg: EchoConfig, state: TrainerState, ledger: GrantLedger,
                 quarantine: Quarantined | None = None):
        self.run, self.term, self.cfg, self.state, self.ledger = run, term, cfg, state, ledger  # term: the lease's
        self.quarantine = quarantine
        self.version = state.version
        self.holders = Holders(run, cfg, ledger, quarantine)
        self.standby: set[str] = set()  # the scheduler's (workers/trainer/coordinator.py): granted no work

    async def start(self) -> None:
        # A restarted trainer numbers on; its predecessor's last slots (a few windows of groups in
        # flight) may still be delivered.
        window = (self.cfg.staleness_bound + 1) * self.cfg.trainer.groups_per_step
        self.ledger.resume(await slots_granted(self.run), 4 * window)
        self.subscription = await serve_grants(self.run, self.grant)

    async def ask(self, version: int) -> None:
        self.version = version
        self.ledger.announced(version, time.monotonic())  # published just before the step asks
        self.reissue_lost(self.ledger.take_lost(), accepted=0)
        await self.publish(self.cfg.trainer.groups_per_step)

    async def on_wait(self, missing: int) -> None:
        """Waiting for groups: release the slots of stopped, dead or stalled holders
        (workers/trainer/holders.py), then hand out again whatever was lost."""
        if not await self.holders.release_stalled():
            return
        lost = self.ledger.take_lost()
        if lost:
            log.warning("grants.reissue", version=self.version, lost=len(lost), missing=missing)
            self.reissue_lost(lost, accepted=self.cfg.trainer.groups_per_step - missing)
            await retry_forever("hand out lost work", lambda: self.republish(missing))

    def too_slow_until(self, sampler_id: str, request: GrantRequest) -> int:
        """The version before which `sampler_id` gets no work, its groups too slow for the
        one it runs (0: none)."""
        return 0

    def headroom(self, request: GrantRequest) -> int | None:
        """The slots the mode may still grant for `request` (None: it asks for none this mode
        grants: another pull request, a version not published), before each sampler's share."""
        raise NotImplementedError

    async def grant(self, sampler_id: str, request: GrantRequest) -> Grant:
        """The answer to a sampler asking for work: none for a quarantined sampler or one running
        a previous trainer's weights (it must apply ours first), none yet while fewer than
        `trainer.min_samplers` have asked (ask again soon), else what the mode grants."""
        self.holders.asked(sampler_id, request.process)
        if (self.quarantine and sampler_id in self.quarantine) or request.term != self.term:
            return Grant()
        if sampler_id in self.standby:
            return Grant()
        if request.claimed_s_per_token is not None:  # a quarantined sampler's claim does not move the fleet's
            self.ledger.claimed(sampler_id, request.claimed_s_per_token)
        if (joined := self.holders.joined(sampler_id)) < self.cfg.trainer.min_samplers:
            return Grant(more=True, again_s=ask_again_s(joined))
        if wait_version := self.too_slow_until(sampler_id, request):
            return Grant(again_s=ask_again_s(self.ledger.sharing(time.monotonic()), more=False),
                         wait_version=wait_version)
        # Read only where work would be granted: a thousand idle samplers ask at each budget,
        # and a read each was most of the trainer's CPU a token (2026-12-06); at 1,000 samplers
        # those refused as too slow were half its broker requests (2026-12-07).
        try:
            if (self.headroom(request) or 0) > 0 and await heartbeat_unreadable(self.run, sampler_id):
                return Grant()  # shown as bad_heartbeat; no work until it reads
        except BROKER_ERRORS:  # the broker restarting: the grant cannot be recorded either (below)
            pass
        slots, more = self.grant_work(sampler_id, request)
        sharing = self.ledger.sharing(time.monotonic())  # a crowd's asks spread out
        if slots:
            try:
                await record_slots_granted(self.run, self.ledger.issued)
            except BROKER_ERRORS as e:  # a restarted trainer could number them again: not handed over
                log.warning("grants.grant_unrecorded", sampler=sampler_id, slots=len(slots), reason=repr(e))
                self.ledger.revoke(slots)
                return Grant(more=True, again_s=ask_again_s(sharing))
        noise = [self.ledger.noise_slot(slot) for slot in slots]
        return Grant(slots=slots, prompts=[self.ledger.prompts[slot] for slot in slots], more=more,
                     noise_slots=noise if noise != slots else [], again_s=0.0 if slots else ask_again_s(sharing, more))


class SequentialGranter(Granter):
    """Sequential mode: each step asks for exactly its groups, generated with its version."""

    request: PullRequest | None = None
    granted = 0  # of the current request's groups
    first_slot = 0  # the current request's slots are numbered from here

    async def publish(self, groups: int) -> None:
        # Current before it is published: a sampler may ask for its groups at once.
        self.request, self.granted = PullRequest(request_id=uuid.uuid4().hex, term=self.term,
                                                  version=self.version, groups=groups), 0
        self.first_slot = self.ledger.issued + 1
        await publish_pull_request(self.run, self.request)

    def reissue_lost(self, lost: list[int], accepted: int) -> None:
        # Only the current request's slots matter: older requests' groups are not wanted.
        self.granted -= sum(1 for slot in lost if slot >= self.first_slot)

    async def republish(self, missing: int) -> None:
        # The same request again: samplers that were told it was all given out ask once more.
        await publish_pull_request(self.run, self.request)

    def headroom(self, request: GrantRequest) -> int | None:
        current = self.request
        if current is None or request.pull_request_id != current.request_id or request.version != current.version:
            return None
        return current.groups - self.granted

    def grant_work(self, sampler_id: str, request: GrantRequest) -> tuple[list[int], bool]:
        headroom = self.headroom(request)
        if headroom is None:
            return [], False
        slots, more = self.ledger.grant(sampler_id, request.want, headroom, self.request.groups,
                                         time.monotonic(), request.version)
        self.granted += len(slots)
        return slots, more


class AsyncGranter(Granter):
    """Async mode: the grant budget, so that samplers generate no group that would arrive
    stale (echo/fleet/grants.py). Lost slots are handed out again by raising the allowance. Each
    budget wakes a draw of the idle samplers, and another draw while open slots go untaken."""

    draw = 0  # the budget's, one more each publish
    published_at = 0.0
    # When a sampler measured fast enough for its version was last granted work, and which one;
    # a new version's slots opening counts as such a grant (see too_slow).
    fit_granted: tuple[float, str] = (0.0, "")

    async def start(self) -> None:
        await super().start()
        # A restarted trainer cannot know which of its predecessor's slots are still out: it
        # counts every one not trained as lost, opening a fresh window. Their groups, should
        # they still come, are trained if fresh and on the prompt the slot's draw names
        # (GrantLedger.earlier_prompt), and the window closes by as many then.
        self.reissue_lost([], accepted=0)

    async def ask(self, version: int) -> None:
        self.fit_granted = (time.monotonic(), "")  # a version's slots open: the fast ones' turn first (too_slow)
        await super().ask(version)

    def highest_slot(self) -> int:
        return allowance(self.version, self.cfg.trainer.max_staleness, self.cfg.trainer.groups_per_step, self.state.lost)

    async def publish(self, groups: int) -> None:
        # Samplers watch the budget to ask for work again as soon as there is some.
        now, highest = time.monotonic(), self.highest_slot()
        # Idle: every sampler known and not gone that holds no slot, not only those that asked
        # lately (drawn less, they ask less: counting only them made every sampler drawn).
        idle = max(0, self.holders.alive() - len(self.ledger.holders()))
        budget = GrantBudget(version=self.version, allowance=highest, groups_per_step=groups, draw=self.draw,
                             open=max(0, highest - self.ledger.issued), idle=idle)
        self.draw += 1
        await publish_budget(self.run, budget)
        self.published_at = now

    async def redraw_forever(self) -> None:
        """While slots stay open and nobody takes one for REDRAW_S (those drawn were busy,
        behind, or gone), publish the budget again: it draws other idle samplers."""
        while True:
            await asyncio.sleep(REDRAW_S)
            untaken_s = time.monotonic() - max(self.published_at, self.ledger.granted_at)
            if self.published_at and untaken_s >= REDRAW_S and self.highest_slot() > self.ledger.issued:
                try:
                    await self.publish(self.cfg.trainer.groups_per_step)
                except BROKER_ERRORS as e:  # the broker restarting: the next round tries again
                    log.warning("grants.redraw_failed", reason=repr(e))

    def reissue_lost(self, lost: list[int], accepted: int) -> None:
        """Count what is lost from what is out (echo/fleet/grants.py): `accepted`, the groups the
        step being collected took so far, are not."""
        self.state.lost = lost_slots(self.ledger.issued, len(self.ledger.outstanding), self.version,
                                     self.cfg.trainer.groups_per_step, accepted)

    async def republish(self, missing: int) -> None:
        await self.publish(self.cfg.trainer.groups_per_step)

    def headroom(self, request: GrantRequest) -> int | None:
        if request.pull_request_id is not None or not 0 <= request.version <= self.version:
            return None
        cap = sampler_cap(self.version, self.highest_slot(), request.version, self.cfg.trainer.groups_per_step)
        return cap - self.ledger.issued

    def grant_work(self, sampler_id: str, request: GrantRequest) -> tuple[list[int], bool]:
        headroom, now = self.headroom(request), time.monotonic()
        if headroom is None:
            return [], False
        window = (self.cfg.trainer.max_staleness + 1) * self.cfg.trainer.groups_per_step  # in flight at once
        slots, more = self.ledger.grant(sampler_id, request.want, headroom, window, now, request.version)
        if slots and self.fits(sampler_id, request, now):
            self.fit_granted = (now, sampler_id)
        return slots, more

    def too_slow_until(self, sampler_id: str, request: GrantRequest) -> int:
        """Refused as too slow (below), a sampler waits for the next version, with which its
        groups have a step longer: the draws of its own no longer wake it to be refused again
        (at 1,000 samplers they were a third of the grant requests)."""
        if (self.headroom(request) or 0) <= 0 or not self.too_slow(sampler_id, request, time.monotonic()):
            return 0
        return request.version + 1

    def too_slow(self, sampler_id: str, request: GrantRequest, now: float) -> bool:
        """Whether a long group of `sampler_id`'s, at its pace (see fits), would arrive stale while
        other samplers fast enough take the work (one was granted some within REDRAW_S, or the
        version's slots opened within it): generating it would be wasted. A fleet all slower
        than the trainer's pace is still given it (small swarms, each sampler as slow as the
        steps it sets, starved under a gate that counted any grant as the work taken, its own
        included), and so are partial rollouts, where a long completion takes newer weights
        between its chunks. Counted from a fit grant alone, a version's slots went to whoever
        asked first when they opened (the last fit grant was the version before's). One still
        running an older version gets none while too slow for it, whoever took work lately: the
        fast ones were fetching the new weights, and at 1,000 samplers every stale group was
        granted so; it is judged again once it runs the trainer's version."""
        granted_at, taker = self.fit_granted
        if self.cfg.sampling.chunk_tokens or taker == sampler_id:
            return False
        if now - granted_at >= REDRAW_S and request.version >= self.version:
            return False
        return self.fits(sampler_id, request, now) is False

    def fits(self, sampler_id: str, request: GrantRequest, now: float) -> bool | None:
        """Whether a long group of `sampler_id`'s would arrive fresh at its measured pace, else the
        pace its `request` claims. While the fleet joins, before the trainer's pace is known,
        whether its claim is among the faster half of the fleet's: the first windows went to
        whoever asked first, and the slowest half's groups arrived stale (None: no pace to judge
        by)."""
        claim = request.claimed_s_per_token
        fresh_for = self.ledger.fresh_for_s(request.version, self.cfg.trainer.max_staleness, now)
        if fresh_for is None:
            return None if claim is None else self.ledger.in_the_faster_half(claim)
        long_s = self.ledger.long_group_s(sampler_id, now, claim)
        return None if long_s is None else long_s <= fresh_for


def granter_for(run: RunClient, term: int, cfg: EchoConfig, state: TrainerState, ledger: GrantLedger,
                 quarantine: Quarantined) -> "Granter":
    mode = SequentialGranter if cfg.run.mode == "sequential" else AsyncGranter
    return mode(run, term, cfg, state, ledger, quarantine)
