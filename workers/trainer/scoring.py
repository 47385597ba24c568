"""The trainer's verifiers, in a child process it can kill.

A sampler chooses every text a verifier reads: `\\boxed{7^{9^{8}}}` has math-verify hand sympy a
power tower to evaluate in full (minutes, and memory, for one completion), and a user's or
reasoning-gym's verifier may do the like. So the scorer's work (the prompt checked, each
completion's reward recomputed or its episode replayed) runs here, off the trainer's event loop,
with a budget per completion: `trainer.score_budget_s` of wall time and `trainer.score_memory_mb`
of memory above what the child holds when ready. A completion past either rejects its group as
`verifier_budget`, a strike against its sampler (a bomb cannot be sampled by chance from a
policy); the child is killed and started again, and the step goes on. The group is counted and
acked with the step, never redelivered for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.forkserver
import resource
import signal
from multiprocessing.connection import Connection

import structlog

from echo.config import EchoConfig, SamplingConfig, TaskConfig
from echo.tasks import is_environment, load_task
from echo.trust.scorer import Scored, Scorer
from echo.wire.messages import RolloutGroup

log = structlog.get_logger()

BUDGET_EXCEEDED = "verifier_budget"
START_TIMEOUT_S = 600.0  # importing torch and the task, on a loaded machine: not the sampler's doing
# Children fork from a server that imported these once (a spawned child took 4.5 s here to import
# them): the first is ready in about a second, and one killed for a bomb is replaced as fast.
PRELOAD = ["workers.trainer.scoring", "echo.tasks.math"]


def start_forkserver() -> None:
    """Start the server children fork from, and its imports, now: the trainer calls this before
    building its model, so both load at once."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def _limit_memory(extra_mb: float) -> None:
    """No more address space than the child has now plus `extra_mb`: past it, an allocation
    raises MemoryError. Linux only (/proc); elsewhere the time budget alone holds."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
    except OSError:
        return
    limit = pages * resource.getpagesize() + int(extra_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _warm_up(task) -> None:
    """One verdict before any budget runs: a verifier's first call loads what it needs
    (math-verify's parsers: ~1 s here, several on a loaded machine), which must not count
    against the first completion a sampler sends."""
    with contextlib.suppress(Exception):
        prompt = task.prompt(0)
        if is_environment(task):
            task.episode(prompt).step("\\boxed{0}")
        else:
            task.score("\\boxed{0}", prompt)


def _serve(conn: Connection, task: TaskConfig, tokenizer, vocab_size: int, sampling: SamplingConfig,
           memory_mb: float) -> None:
    """The child: score each group sent, saying when each completion is done (None), then its
    Scored; until the trainer closes its end (it exited, or was killed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer ends this
    scorer = Scorer(load_task(task), tokenizer, vocab_size, sampling)
    _warm_up(scorer.task)
    _limit_memory(memory_mb)
    conn.send("ready")
    while True:
        try:
            group = conn.recv()
        except EOFError:
            return
        try:
            scored = scorer.score(group, completion_done=lambda: conn.send(None))
        except MemoryError:
            scored = Scored(BUDGET_EXCEEDED, [], lie=True)
        conn.send(scored)


class ScoringProcess:
    """`score(group)`: what the scorer makes of it (Scored), computed in the child within the budget."""

    def __init__(self, task: TaskConfig, tokenizer, vocab_size: int, sampling: SamplingConfig, budget_s: float,
                 memory_mb: float):
        self.child_args = (task, tokenizer, vocab_size, sampling, memory_mb)
        self.budget_s = budget_s
        self.child: multiprocessing.Process | None = None
        self.conn: Connection | None = None
        self.ready = False  # the child said so: its task and verifier are loaded
        self.restarts = 0

    @classmethod
    def of(cls, cfg: EchoConfig, tokenizer, vocab_size: int) -> ScoringProcess:
        return cls(cfg.task, tokenizer, vocab_size, cfg.sampling, cfg.trainer.score_budget_s,
                   cfg.trainer.score_memory_mb)

    async def __aenter__(self) -> ScoringProcess:
        await self._start()  # it loads while the trainer resumes and waits for its first groups
        return self

    async def __aexit__(self, *exc) -> None:
        self._kill()

    async def score(self, group: RolloutGroup) -> Scored:
        if self.child is None:
            await self._start()
        if not self.ready:
            await self._wait_ready()
        self.conn.send(group)
        try:
            while (answer := await self._receive(self.budget_s)) is None:
                pass  # a completion scored in time: the next has its own budget
            return answer
        except (TimeoutError, EOFError) as e:
            log.warning("scoring.budget_exceeded", group=group.group_id, sampler=group.sampler_id,
                        budget_s=self.budget_s, why=type(e).__name__)
            self._kill()  # mid-verification: only a new child is in a known state
            self.restarts += 1
            return Scored(BUDGET_EXCEEDED, [], lie=True)
        except BaseException:  # cancelled (SIGTERM) mid-verification
            self._kill()
            raise

    async def _receive(self, timeout: float):
        if not await asyncio.to_thread(self.conn.poll, timeout):
            raise TimeoutError
        return self.conn.recv()

    async def _start(self) -> None:
        # Forked from the fork server (start_forkserver), not from the trainer: the trainer has
        # threads (torch, nats-py) a fork would copy mid-lock.
        context = multiprocessing.get_context("forkserver")
        self.conn, child_end = context.Pipe()
        self.child = context.Process(
            target=_serve, args=(child_end, *self.child_args), name="echo-scoring", daemon=True)
        await asyncio.to_thread(self.child.start)
        child_end.close()

    async def _wait_ready(self) -> None:
        try:
            if await self._receive(START_TIMEOUT_S) != "ready":
                raise EOFError
        except (TimeoutError, EOFError):
            self._kill()
            raise RuntimeError("the scoring process did not start (its task or tokenizer failed to load)") from None
        self.ready = True

    def _kill(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.join()
            self.child, self.ready = None, False
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None
