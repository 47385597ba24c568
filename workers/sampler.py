"""The sampler process: follow the policy weights, generate rollout groups, publish them.

async mode: generate continuously with the newest weights it has, swapping between calls.
sequential mode: wait for a pull request, make sure it runs exactly the requested version,
then ask the trainer for the request's groups a few at a time and generate them.
Either way the trainer grants the work (streams/grants.py): a sampler generates nothing unasked.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import structlog

from echo.config import EchoConfig, SamplingConfig
from echo.devices import dtype_name
from echo.engines import make_engine
from echo.engines.base import BetweenChunks, Engine, call_seed
from echo.environments import play_episodes, plays_episodes
from echo.learner import set_threads
from echo.logs import bind_process
from echo.models import base_model_digest
from echo.policy import WeightsMismatch
from echo.protocol import (Completion, Grant, GrantRequest, PolicyVersion, PullRequest, RolloutGroup, SamplerStatus,
                           Schedule, VersionChange, WeightsAnnouncement)
from echo.tasks import Task, load_task, safe_reward
from echo.throughput import CallWindow
from streams.client import BROKER_ERRORS, LatestValue, Run, open_run
from streams.credentials import credentials_of
from streams.grants import request_grant, watch_budget
from streams.quarantine import read_quarantine
from streams.registry import put_status, read_learner, weights_relay
from streams.schedule import watch_schedule
from streams.rollouts import publish_rollout
from streams.weights import WeightsFollower
from workers.background import Background

log = structlog.get_logger()

ASK_AGAIN_S = 0.2
NO_ANSWER_WAIT_S = 1.0  # no trainer answered a request for work (none yet, or a broker restarting)
SYNCS_KEPT = 8


class Sampler:
    def __init__(self, cfg: EchoConfig, sampler_id: str, run: Run, engine: Engine, task: Task):
        self.cfg, self.sampler_id, self.run, self.engine, self.task = cfg, sampler_id, run, engine, task
        self.rng = random.Random(f"{cfg.run.seed}/{sampler_id}")  # prompts; the noise: call_seed
        self.weights = WeightsFollower(run, base_model_digest(cfg.model.name))
        self.policy = PolicyVersion(0, -1)  # what the engine runs
        self.refused = PolicyVersion(0, -1)  # the newest weights the engine refused: not tried again, nor waited for
        self.published = 0
        self.quarantined = False  # the trainer ignores this sampler's groups (it shows in the heartbeat)
        self.draining = False  # stopping: its last heartbeat says so
        self.standby = False  # the scheduler's choice: keep the weights current, take no work
        self.finished = False  # the trainer said the run has finished (it shows in the heartbeat)
        self.calls = CallWindow(cfg.sampler.rate_window_s)
        self.syncs: dict[str, float] = {}  # its last SYNCS_KEPT versions: heard of to running
        self.relay = ""  # the relay's JetStream domain, if it reads weights from one (serve)
        self.budget_changed = asyncio.Event()  # async mode: set by watch_budget, so an idle sampler asks again

    @property
    def version(self) -> int:
        """The policy version the engine runs now; -1 before the first."""
        return self.policy.version

    async def apply_newest(self, at_least: int = 0, epoch: int | None = None) -> None:
        """Swap in the newest downloaded weights, waiting for version `at_least` (of `epoch`)
        if needed. A generation in flight is not touched here: it swaps between its chunks
        (swap_between_chunks), or not at all."""
        announcement, shards = await self.weights.wait_for(at_least, epoch)
        if announcement.policy > max(self.policy, self.refused):
            await asyncio.to_thread(self.load, announcement, shards)

    def swap_between_chunks(self) -> int | None:
        """Partial rollouts: called from the engine's thread between chunks of a generation. The
        newest downloaded weights of the epoch it began with, if newer: their version."""
        time.sleep(self.cfg.sampler.throttle_s)  # a slower machine, when asked: slower chunks too
        ready = self.weights.ready
        if ready is None or ready[0].epoch != self.policy.epoch or ready[0].policy <= max(self.policy, self.refused):
            return None
        return self.version if self.load(*ready) else None

    def load(self, announcement: WeightsAnnouncement, shards: list[bytearray]) -> bool:
        """Swap `announcement`'s weights into the engine, off the event loop; False if it refused them."""
        started = time.perf_counter()
        try:
            self.engine.load_weights(shards)
        except WeightsMismatch as e:
            self.refused = announcement.policy
            self.weights.failures["weights_mismatch"] += 1
            log.warning("weights.refused", version=announcement.version, reason=str(e))
            return False
        self.policy = announcement.policy
        bind_process(version=self.version)
        fetched = self.weights.fetch_s.get(announcement.policy, 0.0)
        self.syncs = dict(list(self.syncs.items())[-SYNCS_KEPT + 1:])
        self.syncs[str(announcement.version)] = round(fetched + time.perf_counter() - started, 4)
        log.debug("weights.applied", version=self.version)
        return True

    async def ask_for_work(self, pull_request_id: str | None = None) -> Grant | None:
        """What the trainer grants this sampler to generate with the weights it runs now (None:
        no answer came)."""
        request = GrantRequest(want=self.cfg.sampling.prompts_per_call, epoch=self.policy.epoch, version=self.policy.version,
                               pull_request_id=pull_request_id)
        return await request_grant(self.run, self.sampler_id, request)

    async def generate_and_publish(self, slots: list[int], asked_at: float | None = None) -> None:
        """One group per slot the trainer granted (asked for at `asked_at`, perf_counter), each
        naming its slot. The call's time, from asking to published, is measured."""
        prompts = [self.task.prompt(self.rng.randrange(2**31)) for _ in slots]
        seed = call_seed(self.cfg.run.seed, self.sampler_id, self.policy.epoch, slots[0])
        started = time.perf_counter()
        groups = await asyncio.to_thread(generate_groups, self.engine, self.task, prompts, self.cfg.sampling,
                                         self.sampler_id, self.policy, slots, self.swap_between_chunks, seed)
        await asyncio.sleep(self.cfg.sampler.throttle_s * len(slots))  # a slower machine, when asked
        for group in groups:
            await publish_rollout(self.run, group)
            self.published += 1
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        self.calls.add(time.monotonic(), time.perf_counter() - (started if asked_at is None else asked_at), len(slots),
                       tokens)

    async def run_async(self) -> None:
        """Generate only what the trainer grants under its admission budget, so no work arrives
        stale. With nothing granted, wait until the budget or this sampler's weights change (or
        5 s pass)."""
        while True:
            self.budget_changed.clear()  # before reading the budget: no update can slip past
            await self.apply_newest()
            if not self.standby:
                asked_at = time.perf_counter()
                grant = await self.ask_for_work()
                if grant and grant.slots:
                    await self.generate_and_publish(grant.slots, asked_at)
                    continue
                if grant and grant.more:
                    await asyncio.sleep(ASK_AGAIN_S)  # work is left, just not for this sampler yet
                    continue
            waits = [asyncio.ensure_future(self.budget_changed.wait()),
                     asyncio.ensure_future(self.weights.wait_newer(max(self.policy, self.refused)))]
            _, pending = await asyncio.wait(waits, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()

    async def run_sequential(self) -> None:
        names = self.run.names
        requests = await LatestValue(self.run.js, names.control_stream, names.pull_subject, PullRequest, self._bad_request).start()
        try:
            await self._follow_requests(requests)
        finally:
            await requests.stop()

    async def _follow_requests(self, requests: LatestValue[PullRequest]) -> None:
        seq = 0
        while True:
            seq, request = await requests.wait_newer(seq)
            await self.apply_newest(request.version, request.epoch)
            if self.policy != (request.epoch, request.version):
                continue  # the trainer has moved past this request already
            while requests.seq == seq:
                if self.standby:
                    await asyncio.sleep(ASK_AGAIN_S)
                    continue
                asked_at = time.perf_counter()
                grant = await self.ask_for_work(request.request_id)
                if grant is None:  # no answer: the request may still want its groups
                    await asyncio.sleep(NO_ANSWER_WAIT_S)
                elif grant.slots:
                    await self.generate_and_publish(grant.slots, asked_at)
                elif grant.more:
                    await asyncio.sleep(ASK_AGAIN_S)  # work is left, just not for this sampler yet
                else:
                    break  # the request's groups are all given out: wait for the next request

    def status(self) -> SamplerStatus:
        rates = self.calls.rates(time.monotonic())
        scfg = self.cfg.sampler
        return SamplerStatus(
            sampler_id=self.sampler_id,
            version=self.version,
            groups_published=self.published,
            weight_failures=dict(self.weights.failures),
            updated_at=time.time(),
            state="draining" if self.draining else "quarantined" if self.quarantined else
            "finished" if self.finished else "standby" if self.standby else "active",
            ttl_s=scfg.entry_ttl_s,
            engine=self.engine.name,
            device=str(self.engine.device),
            model=self.cfg.model.name,
            relay=self.relay,
            cost_per_hour=scfg.cost_per_hour,
            groups_per_s=round(rates.groups_per_s, 4),
            tokens_per_s=round(rates.tokens_per_s, 2),
            call_s=round(rates.call_s, 4),
            sync_s=self.syncs,
        )

    async def beat(self) -> None:
        self.quarantined = self.sampler_id in await read_quarantine(self.run)
        if self.quarantined:
            log.warning("sampler.quarantined", sampler=self.sampler_id, lift="echo-rl quarantine lift")
        learner = await read_learner(self.run)
        finished = learner is not None and learner.finished  # until a trainer takes the run further
        if finished and not self.finished:
            log.info("sampler.run_finished", step=learner.step, waiting="in case the run goes on: stop this "
                     "sampler when it is done with")
        self.finished = finished
        await put_status(self.run, self.status())

    async def try_beat(self) -> None:
        """A beat the broker misses (restarting, unreachable) is logged and the next one tried;
        any other error ends the sampler, whose process then exits non-zero."""
        try:
            await self.beat()
        except BROKER_ERRORS as e:
            log.warning("sampler.heartbeat_failed", reason=repr(e))

    async def beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sampler.heartbeat_s)
            await self.try_beat()

    def follow_schedule(self, schedule: Schedule) -> None:
        standby = self.sampler_id in schedule.standby
        if standby != self.standby:
            log.info("sampler.standby" if standby else "sampler.active", why=schedule.why)
            self.standby = standby
            self.budget_changed.set()  # an idle sampler asks for work at once

    def _bad_request(self, error) -> None:
        log.warning("pull.bad_request", reason=str(error))

    async def serve(self) -> None:
        """Generate and heartbeat until stopped; if either fails, both stop and the error is raised."""
        await self.weights.start()
        self.relay = await weights_relay(self.run, self.cfg.nats.hub_domain)
        log.info("sampler.ready", sampler=self.sampler_id, mode=self.cfg.run.mode, engine=self.engine.name,
                 device=str(self.engine.device), dtype=dtype_name(self.engine.dtype), relay=self.relay or None)
        # Registered before it asks for work: the trainer releases at once the slots of a sampler
        # whose entry says "draining", which a previous run of this id may have left.
        await self.try_beat()
        try:
            async with Background() as background:
                background.start(self.beat_forever())
                background.start(watch_schedule(self.run, self.follow_schedule))
                if self.cfg.run.mode == "sequential":
                    await self.run_sequential()
                else:
                    background.start(watch_budget(self.run, self.budget_changed))
                    await self.run_async()
        finally:
            self.draining = True
            try:
                await self.beat()  # the last word: what it did in total
            except BROKER_ERRORS as e:
                log.warning("sampler.last_heartbeat_failed", reason=repr(e))
            await self.weights.stop()
            log.info("sampler.stopped", published=self.published, version=self.version, failures=dict(self.weights.failures))


def generate_groups(engine: Engine, task: Task, prompts: list, sampling: SamplingConfig, sampler_id: str,
                    policy: PolicyVersion, slots: list[int],
                    between_chunks: BetweenChunks | None = None, seed: int | None = None) -> list[RolloutGroup]:
    """One group per prompt (and slot), generated by `engine` beginning with `policy` (epoch,
    version; newer weights may take over between chunks) with sampling noise `seed`, the
    sampler's rewards from the task's verifier. A multi-turn task's completions are episodes,
    played turn by turn with the policy that began them (echo/environments.py)."""
    prompt_ids = [engine.encode_chat(p.messages) for p in prompts]
    started = time.perf_counter()
    if plays_episodes(task):
        completions = play_episodes(engine, task, prompts, prompt_ids, sampling.group_size, sampling.max_new_tokens,
                                    seed=seed)
        changes = [[] for _ in prompts]
    else:
        generations = engine.generate(prompt_ids, sampling.group_size, between_chunks=between_chunks, seed=seed)
        completions = [[Completion(token_ids=g.token_ids, logprobs=g.logprobs, text=g.text,
                                   reward=safe_reward(task, g.text, prompt) or 0.0, finish_reason=g.finish_reason)
                        for g in gens] for prompt, gens in zip(prompts, generations)]
        # its completions were sampled together: the longest saw every change
        changes = [max((g.version_changes for g in gens), key=len) for gens in generations]
    seconds = time.perf_counter() - started
    return [
        RolloutGroup(
            group_id=uuid.uuid4().hex,
            sampler_id=sampler_id,
            policy_version=policy.version,
            epoch=policy.epoch,
            task=task.name,
            prompt_index=prompt.index,
            slot=slot,
            prompt_token_ids=ids,
            completions=group,
            temperature=sampling.temperature,
            engine=engine.name,
            dtype=dtype_name(engine.dtype),
            gen_seconds=seconds / len(prompts),
            created_at=time.time(),
            version_changes=[VersionChange(at=at, version=v) for at, v in group_changes],
        )
        for slot, prompt, ids, group, group_changes in zip(slots, prompts, prompt_ids, completions, changes)
    ]


async def run_sampler(cfg: EchoConfig, sampler_id: str) -> None:
    set_threads(cfg.sampler.threads)
    run = await open_run(cfg.nats.url, cfg.run.id, f"sampler-{sampler_id}", cfg.nats.hub_domain or None,
                         credentials=credentials_of(cfg.nats.creds, cfg.nats.tls_ca), create=False,
                         weights_url=cfg.nats.weights_url or None)
    try:
        engine = make_engine(cfg)
        await Sampler(cfg, sampler_id, run, engine, load_task(cfg.task)).serve()
    finally:
        await run.close()
