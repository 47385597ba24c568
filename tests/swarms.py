"""`echo-rl up` swarms on the tiny model for the end-to-end tests: the command, and a finished
run's checks (both samplers ran, nothing refused, every message accounted for)."""

import asyncio
import subprocess
import sys
import threading

import orjson
import pytest

from echo.fleet.grants import DeliveryBound
from streams.client import open_run
from streams.registry import read_statuses, read_trainer_status
from streams.replay import read_rollouts, run_broker
from tests.conftest import assert_balanced, stopped

SMALL = ["lora.r=4", "sampling.group_size=4", "sampling.max_new_tokens=8", "trainer.groups_per_step=4", "run.eval_prompts=0"]


def up_command(tmp_path, run_id: str, steps: int, *overrides: str, flags=(), model: str = "tiny") -> list[str]:
    cmd = [sys.executable, "-m", "workers.cli", "up", "--model", model, "--steps", str(steps), "--run-id", run_id, *flags]
    for assignment in [f'run.dir="{tmp_path}"', *SMALL, *overrides]:
        cmd += ["--set", assignment]
    return cmd


def run_swarm(tmp_path, run_id: str, steps: int, *overrides: str, flags=(), samplers=frozenset({"s1", "s2"}),
              model: str = "tiny", meanwhile=None):
    """`up`'s run, checked; `meanwhile(pid)`, if given, runs beside it (up's pid: what to disturb:
    a sampler it restarts counts its groups afresh, so the heartbeats' counts are not summed)."""
    # Each sampler's heartbeat is read after the run: it must outlive the run's end on a busy box
    # (an entry expires sampler.entry_ttl_s, 30 s, after its last beat; under a load of 8 on 2
    # cores, up's teardown and the read took longer, and a sampler's entry was gone).
    cmd = up_command(tmp_path, run_id, steps, "sampler.entry_ttl_s=3600", *overrides, flags=flags, model=model)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        if meanwhile is not None:
            threading.Thread(target=meanwhile, args=(proc.pid,), daemon=True).start()
        try:
            _, stderr = proc.communicate(timeout=900)  # a hang guard: a run here takes 1-4 min
        finally:
            stopped(proc)
    assert proc.returncode == 0, stderr[-3000:]
    run_dir = tmp_path / run_id
    metrics = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]

    async def read(url: str, credentials):
        run = await open_run(url, run_id, "check", credentials=credentials, create=False)
        statuses, trainer = await read_statuses(run), await read_trainer_status(run)
        await run.close()
        return [r async for r in read_rollouts(url, run_id, credentials)], statuses, trainer

    with run_broker(run_dir, None) as (url, _, credentials):  # the run's own store, after the run
        stream, statuses, trainer = asyncio.run(read(url, credentials))
    assert {s.sampler_id for s in statuses} == samplers  # each ran and heartbeat
    # Honest samplers deliver their slots: none undelivered past the bound (echo/fleet/grants.py).
    assert all(s.undelivered <= DeliveryBound().most for s in trainer.slots.values()), trainer.slots
    assert all(s.weight_failures == {} for s in statuses), statuses  # no weights refused (size, digest, delta)
    # Every group trained came from them. How many each made is up to its speed: in a run of a few
    # tenths of a second, a sampler a version behind the other may be granted nothing (its slot
    # cap is a step lower), so only the 5-step async test checks that both contribute.
    assert meanwhile or sum(s.groups_published for s in statuses) >= sum(m["used"] for m in metrics), statuses
    assert_balanced(metrics, stream)
    # Busy: everything but waiting for groups, the share `echo-rl status` and the capacity model use.
    assert all(m["utilisation"] == pytest.approx(m["busy_seconds"] / (m["busy_seconds"] + m["wait_seconds"]))
               for m in metrics)
    return metrics, stream, stderr


def assert_every_group_proved(metrics: list[dict]) -> None:
    """trainer.verify_fraction = 1.0: every group trained passed the proof of sampling, none refused."""
    proof = metrics[-1]["proof_of_sampling"]
    assert proof.get("passed", 0) >= sum(m["used"] for m in metrics) and set(proof) == {"passed"}, proof
    assert all(m["rejected"] == {} for m in metrics), [m["rejected"] for m in metrics]


USER_TASK = '''
from echo.tasks import GeneratedTask, Score


class Shout(GeneratedTask):
    """A user's task, outside the package: reward completions that contain a capital letter."""

    name = "shout"

    def __init__(self, params):
        self.word = params["word"]

    def generate(self, rng):
        return [{"role": "user", "content": f"Shout {self.word} {rng.randint(0, 999)}"}], self.word

    def score(self, completion, prompt):
        ok = any(c.isupper() for c in completion)
        return Score(float(ok), ok, ok)
'''


# A user's environment written to `verifiers`' own interface (echo/tasks/verifiers_env.py): a
# parser and a rubric of weighted functions, one of which a random model earns now and then.
VERIFIERS_ENV = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 200, eval_n: int = 12):
    def rows(first, count):
        return [{"question": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)} for i in range(first, first + count)]

    parser = vf.XMLParser(["answer"])

    def correct_answer(completion, answer) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    async def shout(completion) -> float:  # async, as rubric functions may be
        text = parser.get_assistant_messages(completion)[-1]["content"] or ""
        return float(any(c.isupper() for c in text))

    rubric = vf.Rubric(funcs=[correct_answer, shout, parser.get_format_reward_func()], weights=[1.0, 0.3, 0.2],
                       parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows(0, n)), eval_dataset=Dataset.from_list(rows(n, eval_n)),
                            system_prompt="Answer inside <answer></answer>.", parser=parser, rubric=rubric)
'''


OPENENV_GUESS = '''  # the guess game as an OpenEnv environment
import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess a number from 1 to 9, told higher or lower; reward 1 when guessed."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # one server may hold a group's episodes at once

    def __init__(self, top: int = 9, seeded: bool = True):
        super().__init__()
        self.top, self.seeded = top, seeded
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        rng = random.Random(seed) if self.seeded else random.Random()
        self.secret, self._state = rng.randint(1, self.top), State(step_count=0)
        game = "" if self.seeded else f" (game {rng.random()})"  # not the seed's: no replay could check it
        return GuessObservation(message=f"Guess my number, 1 to {self.top}{game}.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        guess = action.guess.strip()
        if guess == str(self.secret):
            return GuessObservation(message="right", done=True, reward=1.0)
        said = "higher" if guess.isdigit() and int(guess) < self.secret else "lower"
        return GuessObservation(message=f"{guess!r}: {said}", reward=0.0)

    @property
    def state(self):
        return self._state
'''
