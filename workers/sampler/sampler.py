"""The sampler process: follow the policy weights, generate rollout groups, publish them.

async mode: generate continuously with the newest weights it has, swapping between calls.
sequential mode: wait for a pull request, make sure it runs exactly the requested version,
then ask the trainer for the request's groups a few at a time and generate them.

This file is the process and its two loops; the other rooms of the wing: workers/sampler/__init__.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog

from echo.config import EchoConfig
from echo.engines import make_engine
from echo.engines.base import Engine
from echo.fleet.grants import ASK_AGAIN_MIN_S
from echo.model.devices import dtype_name
from echo.tasks import Task, load_task
from echo.train.learner import set_threads
from echo.wire.messages import Grant, PullRequest
from streams.client import RunClient, open_run
from streams.credentials import credentials_of
from streams.grants import watch_budget
from streams.registry import weights_relay
from streams.schedule import watch_schedule
from streams.watch import LatestValue
from workers.background import Background
from workers.sampler.generation import Generation
from workers.sampler.heartbeat import Heartbeat
from workers.sampler.ranks import start_ranks
from workers.sampler.weights import EngineWeights
from workers.sampler.work import Work

log = structlog.get_logger()

# The least wait is the trainer's own (echo/fleet/grants.py: ASK_AGAIN_MIN_S for a grant's more with
# no again_s, a trainer before schema 25); this is the longest heeded, whatever a grant says.
ASK_AGAIN_MAX_S = 30.0
NO_ANSWER_WAIT_S = 1.0  # no trainer answered a request for work (none yet, or a broker restarting)


class Sampler:
    def __init__(self, cfg: EchoConfig, sampler_id: str, run: RunClient, engine: Engine, task: Task):
        self.cfg, self.sampler_id, self.run = cfg, sampler_id, run
        self.weights = EngineWeights(run, engine, cfg.model.name, cfg.sampler.throttle_s)
        # This process, named in its requests and heartbeats: a restart under the same id is told
        # from it, and the slots this one held are released at once.
        process = uuid.uuid4().hex
        self.work = Work(run, sampler_id, cfg.sampling.prompts_per_call, process)
        self.generation = Generation(cfg, sampler_id, run, task, self.weights)
        self.heartbeat = Heartbeat(cfg, sampler_id, run, self.weights, self.generation, self.work)

    async def run_async(self) -> None:
        """Generate only what the trainer grants under its grant budget, so no work arrives
        stale. With nothing granted, wait until this sampler's weights change or a budget draws
        it, or the time the trainer said (5 s, longer among many) is up (Work.idle)."""
        # Woken by a budget or weights, it asks where the newest budget drew it and it runs that
        # budget's version (the rest of a crowd takes the slots), or where a new trainer took over;
        # and always after a call, a wait for work left, or a wait that timed out.
        anyway, asked_term = True, None
        while True:
            self.work.changed.clear()  # before reading the budget: no update can slip past
            await self.weights.apply_newest()
            await self.heartbeat.first_weights()
            if self.work.claimed_s_per_token is None:  # once, after the engine's first load (as any call is)
                self.work.claimed_s_per_token = await self.generation.warm_up()
            running, drawn = self.weights.running, self.work.drawn
            if (anyway or (drawn is not None and running.version >= drawn) or running.term != asked_term) \
                    and not self.work.standby:
                asked_at, asked_term = time.perf_counter(), running.term
                grant = await self.work.ask(running)
                if grant and grant.slots:
                    await self.generation.generate_and_publish(grant, asked_at)
                    anyway = True
                    continue
                if grant and grant.more:
                    await asyncio.sleep(again_s(grant))  # work is left, just not for this sampler yet
                    anyway = True
                    continue
            anyway = await self.work.idle(self.weights.wait_newer())

    async def run_sequential(self) -> None:
        names = self.run.names
        requests = await LatestValue(self.run.js, names.control_stream, names.pull_subject, PullRequest,
                                     lambda error: log.warning("pull.bad_request", reason=str(error))).start()
        try:
            seq = 0
            while True:
                seq, request = await requests.wait_newer(seq)
                self.work.pull_request = request
                await self.weights.apply_newest(request.version, request.term)
                await self.heartbeat.first_weights()
                if self.weights.running != (request.term, request.version):
                    continue  # the trainer has moved past this request already
                while requests.seq == seq and await self.fill(request):
                    pass
        finally:
            await requests.stop()

    async def fill(self, request: PullRequest) -> bool:
        """One round of asking for `request`'s groups and generating what is granted; False once
        they are all given out."""
        if self.work.standby:
            await asyncio.sleep(ASK_AGAIN_MIN_S)
            return True
        asked_at = time.perf_counter()
        grant = await self.work.ask(self.weights.running, request.request_id)
        if grant is None:  # no answer: the request may still want its groups
            await asyncio.sleep(NO_ANSWER_WAIT_S)
        elif grant.slots:
            await self.generation.generate_and_publish(grant, asked_at)
        elif grant.more:
            await asyncio.sleep(again_s(grant))  # work is left, just not for this sampler yet
        else:
            return False  # wait for the next request
        return True

    async def serve(self) -> None:
        """Generate and heartbeat until stopped; if either fails, both stop and the error is raised."""
        await self.weights.start()
        engine = self.weights.engine
        self.heartbeat.relay = weights_relay(self.run, self.cfg.nats.hub_domain)
        log.info("sampler.ready", sampler=self.sampler_id, mode=self.cfg.run.mode, engine=engine.name,
                 device=str(engine.device), dtype=dtype_name(engine.dtype), relay=self.heartbeat.relay or None)
        # Registered before it asks for work: the trainer releases at once the slots of a sampler
        # whose entry says "draining", which a previous run of this id may have left.
        await self.heartbeat.try_beat()
        try:
            async with Background() as background:
                background.start(self.heartbeat.beat_forever())
                background.start(watch_schedule(self.run, self.work.follow_schedule))
                if self.cfg.run.mode == "sequential":
                    await self.run_sequential()
                else:
                    background.start(watch_budget(self.run, self.work.follow_budget))
                    await self.run_async()
        finally:
            try:
                await self.heartbeat.last_beat()
            finally:  # cancelled again meanwhile (cancel_until_done), the weights are still stopped
                await self.weights.stop()
            log.info("sampler.stopped", published=self.generation.published, version=self.weights.version,
                     failures=dict(self.weights.follower.failures))


def again_s(grant: Grant) -> float:
    """How long to wait before asking again where work is left but none was granted: as the
    trainer says (it spreads a crowd's asks), within ASK_AGAIN_MAX_S."""
    return min(grant.again_s or ASK_AGAIN_MIN_S, ASK_AGAIN_MAX_S)


async def run_sampler(cfg: EchoConfig, sampler_id: str) -> None:
    set_threads(cfg.sampler.threads)
    run = await open_run(cfg.nats.url, cfg.run.id, f"sampler-{sampler_id}", cfg.nats.hub_domain or None,
                         credentials=credentials_of(cfg.nats.creds, cfg.nats.tls_ca), create=False,
                         weights_url=cfg.nats.weights_url or None)
    ranks = engine = None
    try:
        group = None
        if cfg.sampler.ranks > 1:  # one model over several processes: this one is rank 0
            group, ranks = start_ranks(cfg)
        engine = make_engine(cfg, sampler_id, group)
        if ranks is not None:
            ranks.engine = engine  # its waits on the other ranks, watched
            log.info("sampler.split", layers=list(engine.layers),
                     weights_mb=[round(mb, 1) for mb in engine.rank_mb])
        try:
            await Sampler(cfg, sampler_id, run, engine, load_task(cfg.task)).serve()
        except RuntimeError as e:  # "[ring] connection to a peer was lost": a rank of another box
            if ranks is None or "[ring]" not in str(e):
                raise
            ranks.lost(f"a collective failed: {e}")
    finally:
        if ranks is not None:
            if engine is not None:  # however it stops (SIGTERM too): else they wait, a remote rank for ever
                with contextlib.suppress(RuntimeError):  # a rank already gone
                    engine.stop_followers()
            ranks.close()
        await run.close()
