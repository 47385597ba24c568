"""Tasks: where prompts come from and how a completion is scored. Pure, no network.

A task serves prompts by index (the same index gives the same prompt in every process, so a
sampler sends only the index and the trainer looks up the ground truth itself), scores a
completion with a verifier, and keeps a held-out set for evaluation that training never sees.

Built-in tasks are named in the config (`task.name = "sokoban"`); reasoning-gym's generators as
`reasoning_gym:<dataset>` (echo/tasks/gym.py, the `tasks` extra); a `verifiers` environment as
`verifiers:<module>` (echo/tasks/verifiers_env.py, the `envs` extra), an OpenEnv one as
`openenv:<module>[:<Class>]` (echo/tasks/openenv_env.py, the `envs` extra too); a user's own as `module:Class`
(importable) or `path/to/file.py:Class`, and gets `task.params` as a dict.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from echo.config import ConfigError, TaskConfig, format_errors

BUILTIN = {
    "math": "echo.tasks.math:Math",
    "math_tools": "echo.tasks.math:MathTools",  # multi-turn, with a calculator (echo/tasks/episodes.py)
    "knights_knaves": "echo.tasks.knights_knaves:KnightsKnaves",
    "sokoban": "echo.tasks.sokoban:Sokoban",
    "sokoban_game": "echo.tasks.sokoban:SokobanGame",  # multi-turn (echo/tasks/episodes.py)
    "dataset": "echo.tasks.dataset:Dataset",  # a user's file of prompts and answers, named on the trainer
}
GYM = "reasoning_gym:"  # reasoning-gym's datasets: echo/tasks/gym.py


@dataclass(frozen=True)
class Family:
    """Tasks named `<prefix><rest>`: a module of ours gives each its class, from a package an extra installs."""

    module: str  # ours, with task_class(rest)
    package: str  # what it needs imported
    needs: str  # how the error names it
    extra: str


FAMILIES = {
    GYM: Family("echo.tasks.gym", "reasoning_gym", "reasoning-gym", "tasks"),
    "verifiers:": Family("echo.tasks.verifiers_env", "verifiers", "verifiers", "envs"),
    "openenv:": Family("echo.tasks.openenv_env", "openenv", "openenv-core", "envs"),
}


@dataclass(frozen=True)
class Prompt:
    index: int
    messages: list[dict]  # chat messages, ending with the user's turn
    answer: str  # what the verifier needs (the ground truth), never shown to the model
    source: str = ""  # where a dataset's row came from (its data_source): some verifiers choose by it


@dataclass(frozen=True)
class Score:
    reward: float  # in [0, 1]
    format_ok: bool
    correct: bool


class Task(Protocol):
    name: str
    environment: bool  # False (or absent): a plain task (one completion, scored); True: an Environment

    def prompt(self, index: int) -> Prompt:
        """The training prompt at `index` (any non-negative integer)."""

    def held_out(self, n: int) -> list[Prompt]:
        """Up to n evaluation prompts, disjoint from every training prompt."""

    def score(self, completion: str, prompt: Prompt) -> Score: ...


@dataclass(frozen=True)
class Step:
    """What an environment answers a model's turn (echo/tasks/episodes.py)."""

    observation: list[dict]  # chat messages to append (empty when done)
    reward: float  # in [0, 1]
    done: bool


class Episode(Protocol):
    def step(self, action: str) -> Step: ...


class Environment(Protocol):
    """A multi-turn task: it declares `environment = True` and plays episodes (echo/tasks/episodes.py)."""

    name: str
    environment: bool
    max_turns: int

    def prompt(self, index: int) -> Prompt: ...

    def held_out(self, n: int) -> list[Prompt]: ...

    def episode(self, prompt: Prompt) -> Episode: ...


def check_rerunnable(task: Environment, actions: list[str], unless: str) -> None:
    """Two plays of the first prompt's episode with the same `actions` must answer alike (each
    step whole: the trainer's rerun sums its rewards too), else no trainer can rerun what a
    sampler played; `unless` names what in the environment could make them differ."""
    plays = []
    for _ in range(2):
        prompt = task.prompt(0)
        episode, answers = task.episode(prompt), [prompt.messages]
        for action in actions:
            step = episode.step(action)
            answers.append(step)
            if step.done:
                break
        plays.append(answers)
    if plays[0] != plays[1]:
        raise ConfigError(f"task.name {task.name!r}: two plays of one episode with the same turns answered "
                          f"differently, so the trainer cannot replay what a sampler played ({unless}); "
                          "task.params.trust_samplers_for_observations = true takes the samplers' word for every episode")


def safe_score(task: Task, completion: str, prompt: Prompt) -> Score | None:
    """The verifier's score, or None if it raised or gave a reward outside [0, 1]: a bug in a
    task costs that completion (reward 0, counted by the caller), not the run. Out of memory is
    not a bug of the task's: it is raised (the trainer's budget, workers/trainer/scoring.py)."""
    try:
        score = task.score(completion, prompt)
        reward = float(score.reward)
    except MemoryError:
        raise
    except Exception:
        return None
    return Score(reward, bool(score.format_ok), bool(score.correct)) if 0.0 <= reward <= 1.0 else None


def answer_format(task) -> str:
    """What the task's verifier reads an answer from, for a run with no learning signal to name."""
    return getattr(task, "answer_format", "answer its verifier can read")


def asks_for_answer(task, messages: list[dict]) -> bool | None:
    """Whether a prompt asks for the answer in the form the task's verifier reads (names its
    `answer_marker`); None where the task has no marker to look for."""
    marker = getattr(task, "answer_marker", None)
    if marker is None:
        return None
    return any(marker in str(m.get("content", "")) for m in messages)


def is_held_out(messages: list[dict]) -> bool:
    """A fixed tenth of all problems, chosen by a hash of the question, is kept for evaluation."""
    return hashlib.sha256(messages[-1]["content"].encode()).digest()[0] % 10 == 0


class GeneratedTask:
    """Base for tasks whose problems come from a seeded generator."""

    name: str
    environment = False

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        """(messages, answer) of one problem drawn with rng."""
        raise NotImplementedError

    def prompt(self, index: int) -> Prompt:
        for attempt in itertools.count():
            messages, answer = self.generate(random.Random(f"{self.name}/{index}/{attempt}"))
            if not is_held_out(messages):
                return Prompt(index, messages, answer)

    def held_out(self, n: int) -> list[Prompt]:
        prompts, seen = [], set()
        for i in range(200 * n):  # small problem spaces have fewer than n held-out problems
            messages, answer = self.generate(random.Random(f"{self.name}/eval/{i}"))
            question = messages[-1]["content"]
            if is_held_out(messages) and question not in seen:
                seen.add(question)
                prompts.append(Prompt(len(prompts), messages, answer))
                if len(prompts) == n:
                    break
        return prompts


P = TypeVar("P", bound=BaseModel)


def parse_params(model: type[P], params: dict) -> P:
    """A task's own options, checked like the rest of the config: a bad one names its field."""
    try:
        return model.model_validate(params)
    except ValidationError as e:
        raise ConfigError("invalid config: " + format_errors(e, prefix="task.params.", model=model)) from None


def task_class(name: str) -> type:
    """The class a task.name names (a built-in, module:Class or file.py:Class), imported, not yet
    made: a wrong name is said before anything else is done."""
    for prefix, family in FAMILIES.items():
        if name.startswith(prefix):
            if importlib.util.find_spec(family.package) is None:
                raise ConfigError(f"task.name {name!r} needs {family.needs}, an extra the base install leaves out: "
                                  f"pip install 'echo-rl[{family.extra}]'")
            # By name, as the built-ins are: the task modules import this one, never the reverse.
            return importlib.import_module(family.module).task_class(name.removeprefix(prefix))
    path = BUILTIN.get(name, name)
    module_name, _, class_name = path.rpartition(":")
    if not module_name:
        close = difflib.get_close_matches(name, BUILTIN, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(f"task.name {name!r}: {hint}not a built-in task ({', '.join(BUILTIN)}) nor module:Class")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError, FileNotFoundError) as e:
        raise ConfigError(f"task.name {name!r}: {e}") from None


def is_environment(task: Task | Environment | type) -> bool:
    """Whether a task plays episodes: what it declares (`environment = True`); a plain task need
    not declare anything."""
    return getattr(task, "environment", False) is True


def load_task(cfg: TaskConfig) -> Task:
    cls = task_class(cfg.name)
    declared, plays = is_environment(cls), callable(getattr(cls, "episode", None))
    if declared != plays:
        raise ConfigError(f"task.name {cfg.name!r}: environment = {declared} but it "
                          f"{'plays' if plays else 'has no'} episode(): an environment declares environment = True "
                          "and plays episodes; a plain task does neither")
    return cls(cfg.params)
