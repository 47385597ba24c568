"""The samplers that hold the trainer's slots, watched by their heartbeats: who joined, who is
gone (stopped, silent past `trainer.sampler_dead_after_s`, or restarted under its id) and who
holds slots with nothing delivered for too long (the stall rule: GrantLedger.stall_limits_s, at
most `trainer.reissue_after_s`). Their slots are released here; the granter hands out again
what that loses (workers/trainer/granter.py)."""

from __future__ import annotations

import asyncio
import time

import structlog

from echo.config import EchoConfig
from echo.fleet.grants import GrantLedger, Heartbeats
from streams.client import BROKER_ERRORS, RunClient
from streams.registry import read_heartbeats
from workers.trainer.strikes import Quarantined

log = structlog.get_logger()


class Holders:
    def __init__(self, run: RunClient, cfg: EchoConfig, ledger: GrantLedger, quarantine: Quarantined | None):
        self.run, self.cfg, self.ledger, self.quarantine = run, cfg, ledger, quarantine
        self.fleet: set[str] = set()  # samplers that asked for work since this trainer started
        self.gone: set[str] = set()  # of them, those found stopped or silent, until they ask again
        self.heartbeats = Heartbeats()
        self.heartbeats_read_at: float | None = None  # when the last reading of them ended whole (None: it failed)

    def asked(self, sampler_id: str, process: str) -> None:
        """`sampler_id`'s process `process` asked for work: heard from, and back if it was gone."""
        self.heartbeats.heard(sampler_id, time.monotonic())
        if self.heartbeats.restarted(sampler_id, process):
            self.release_gone(sampler_id, restarted=True)
        elif sampler_id in self.gone:  # silent or stopped, and asking again
            self.rejoined(sampler_id, restarted=False)

    def joined(self, sampler_id: str) -> int:
        """Count `sampler_id` in the fleet; the fleet's size."""
        if sampler_id not in self.fleet:
            self.fleet.add(sampler_id)
            log.info("trainer.sampler_joined", sampler=sampler_id, samplers=len(self.fleet))
        return len(self.fleet)

    def alive(self) -> int:
        return len(self.fleet - self.gone)

    async def watch_heartbeats(self) -> None:
        """Read the holders' heartbeats while the trainer runs, whatever its step is doing: a
        stopping sampler's last one (`draining`) lives only `sampler.entry_ttl_s`, which a step
        busy training or scoring may outlast; read here, it is remembered until its slots go."""
        while True:
            await self.read_heartbeats()
            await asyncio.sleep(self.heartbeats_every_s)

    @property
    def heartbeats_every_s(self) -> float:
        return min(self.cfg.sampler.heartbeat_s, self.cfg.sampler.entry_ttl_s / 2)

    async def read_heartbeats(self) -> bool:
        """Observe each holder's heartbeat; False when the broker could not be read (the next
        reading tries again)."""
        try:
            heartbeats = await read_heartbeats(self.run, sorted(self.ledger.holders()))
        except BROKER_ERRORS as e:  # the broker restarting
            log.warning("grants.heartbeats_unread", reason=repr(e))
            self.heartbeats_read_at = None
            return False
        for sampler_id, (revision, status) in heartbeats.items():
            process, stopping = (status.process, status.state == "draining") if status else ("", False)
            if self.heartbeats.observe(sampler_id, revision, time.monotonic(), process, stopping):
                self.release_gone(sampler_id, restarted=True)
        self.heartbeats_read_at = time.monotonic()
        return True

    def release_gone(self, sampler_id: str, **why) -> None:
        """The holder's process is gone (restarted under its id, stopped, or silent past
        `trainer.sampler_dead_after_s`): its slots go at once, with no strike; a process restarted
        under `sampler_id` never saw its predecessor's (before, they waited for
        `trainer.reissue_after_s`: its heartbeat hid the death)."""
        slots = self.ledger.release(sampler_id)
        self.heartbeats.stopped.discard(sampler_id)
        if slots:
            log.warning("grants.slots_released", sampler=sampler_id, slots=len(slots), **why)
        if why.get("restarted"):
            self.rejoined(sampler_id, restarted=True)
        elif sampler_id not in self.gone:
            self.gone.add(sampler_id)
            alive = self.alive()
            log.warning("trainer.sampler_gone", sampler=sampler_id, samplers_alive=alive, **why)
            if not alive:  # the run waits: say so, not nothing
                log.warning("trainer.no_samplers", waiting_for="a sampler to join or rejoin", run=self.cfg.run.id)

    def rejoined(self, sampler_id: str, restarted: bool) -> None:
        self.gone.discard(sampler_id)
        log.info("trainer.sampler_rejoined", sampler=sampler_id, restarted=restarted,
                 samplers_alive=self.alive())

    async def release_stalled(self) -> bool:
        """Release the slots of stopped, dead or stalled holders; False where the broker could not
        be read (none is judged then). The heartbeats are read again only where the last reading
        is older than a heartbeat (watch_heartbeats reads them that often): read at every wait, a
        second apart, 256 holders' were most of the trainer's broker requests at 1,000 samplers."""
        read_at = self.heartbeats_read_at
        fresh = read_at is not None and time.monotonic() - read_at < self.heartbeats_every_s
        if not fresh and not await self.read_heartbeats():
            return False
        now, trainer, holders = time.monotonic(), self.cfg.trainer, sorted(self.ledger.holders())
        # At least twice the silence that declares death: a sampler that died holding slots is
        # found silent first (its slots then go at once, and no strike).
        limits_s = self.ledger.stall_limits_s(holders, now, 2 * trainer.sampler_dead_after_s, trainer.reissue_after_s)
        for sampler_id in holders:
            stopped = sampler_id in self.heartbeats.stopped  # its last heartbeat: it abandoned them
            silent_s = self.heartbeats.silent_for(sampler_id, now)
            stalled_s, limit_s = now - self.ledger.progress_at[sampler_id], limits_s[sampler_id]
            if stopped or silent_s > trainer.sampler_dead_after_s:
                self.release_gone(sampler_id, stopped=stopped, silent_s=round(silent_s, 1))
            elif stalled_s > trainer.reissue_after_s or (stalled_s > limit_s and self.heartbeats.beating(sampler_id)):
                # Alive (its heartbeat changed since it took them) and none filled: stuck, or hoarding.
                slots, repeat = self.ledger.release_unfilled(sampler_id, now, trainer.reissue_after_s)
                log.warning("grants.slots_released", sampler=sampler_id, slots=len(slots), repeat=repeat,
                            stalled_s=round(stalled_s, 1), limit_s=round(limit_s, 1))
                if repeat and self.quarantine:
                    await self.quarantine.strike(sampler_id, "slots_unfilled")
        return True
