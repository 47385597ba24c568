"""OpenEnv environments as echo-rl environments (the `envs` extra: pip install 'echo-rl[envs]').

    task.name = "openenv:<module>"            the one OpenEnv Environment class the module defines
    task.name = "openenv:<module>:<Class>"    or the one named
    task.params = {env = {...its constructor's arguments}, max_turns, reward_range, instruction}

The environment runs in-process, the way OpenEnv's own server runs it (`reset(seed)`, then
`step(action)` until `done`), a fresh instance for each episode, in every process that plays or
replays one. A prompt index is a seed: the prompt is the observation `reset(seed=index)` gives
(after `instruction`, a system message, if set), and held-out prompts are seeds of their own
range, never a training index. The model's turn becomes the environment's Action: the text
itself where the Action has one text field, else the JSON object in the text; one that does not
validate is answered "invalid action: ..." as a user turn, and the episode goes on. Each
observation is shown as a user turn: its one text field, else its fields as JSON (done, reward
and metadata left out). The rewards of an episode's steps are summed and mapped from
`reward_range` onto [0, 1].

The trainer replays each episode with the sampler's turns (echo/environments.py::replay), so an
environment must answer alike for a seed and the same actions: two plays are compared at start
and one that differs is refused, unless `trust_samplers_for_observations = true` (the trainer
then takes the samplers' word: docs/operations.md).
"""

from __future__ import annotations

import importlib
import inspect
import json
import typing

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.config import ConfigError
from echo.tasks import Prompt, Step, parse_params

PREFIX = "openenv:"
HELD_OUT_SEEDS = 2**31  # held-out episodes reset with seeds from here; training indices stay below
TEXT_FIELDS_SHOWN = ("done", "reward", "metadata")  # an observation's fields the model is not shown


class OpenEnvParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env: dict = {}  # the environment class's constructor arguments
    max_turns: int = Field(8, ge=1, le=100)
    reward_range: tuple[float, float] = (0.0, 1.0)  # what an episode's summed rewards range over
    instruction: str = ""  # a system message before the first observation: how to act, in what form
    trust_samplers_for_observations: bool = False  # see the module's docstring

    @model_validator(mode="after")
    def _range(self) -> OpenEnvParams:
        if not self.reward_range[0] < self.reward_range[1]:
            raise ValueError("reward_range: low below high")
        return self


def task_class(name: str):
    """What echo.tasks.task_class gives for `openenv:<module>[:<Class>]`."""
    module_name, _, class_name = name.partition(":")
    if not module_name:
        raise ConfigError("task.name 'openenv:': name the environment's module, e.g. openenv:my_env")
    return lambda params: OpenEnvTask(PREFIX + name, environment_class(module_name, class_name), params)


def environment_class(module_name: str, class_name: str) -> type:
    from openenv.core.env_server.interfaces import Environment

    name = PREFIX + module_name + (f":{class_name}" if class_name else "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task.name {name!r}: {e}") from None
    if class_name:
        cls = getattr(module, class_name, None)
        if not (inspect.isclass(cls) and issubclass(cls, Environment)):
            raise ConfigError(f"task.name {name!r}: {module_name} has no OpenEnv Environment {class_name}")
        return cls
    found = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Environment)
             and c.__module__ == module.__name__ and not inspect.isabstract(c)]
    if len(found) != 1:
        raise ConfigError(f"task.name {name!r}: {module_name} defines {len(found)} OpenEnv Environment classes "
                          f"({', '.join(c.__name__ for c in found) or 'none'}); name one: {name}:<Class>")
    return found[0]


def action_class(cls: type) -> type:
    """The Action type the environment is declared with (Environment[Action, Observation, State])."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Environment:
                action = typing.get_args(base)[0]
                if inspect.isclass(action) and issubclass(action, Action):
                    return action
    raise ConfigError(f"{cls.__name__}: declare it as Environment[YourAction, YourObservation, State], so that "
                      "echo-rl knows which Action a model's turn becomes")


def _fields(model: type[BaseModel]) -> dict:
    return {k: f for k, f in model.model_fields.items() if k not in TEXT_FIELDS_SHOWN}


def show(observation) -> str:
    """An observation as the model sees it: its one text field, else its fields as JSON."""
    fields = observation.model_dump(exclude=set(TEXT_FIELDS_SHOWN))
    if len(fields) == 1 and isinstance(value := next(iter(fields.values())), str):
        return value
    return json.dumps(fields, sort_keys=True, default=str)


def act(action_cls: type, text: str):
    """The model's turn as the Action, or why it is not one."""
    fields = _fields(action_cls)
    if len(fields) == 1 and next(iter(fields.values())).annotation is str:
        data = {next(iter(fields)): text.strip()}
    else:
        start, end = text.find("{"), text.rfind("}")
        try:
            data = json.loads(text[start : end + 1]) if 0 <= start < end else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return None, f"give the action as a JSON object with {', '.join(fields)}"
    try:
        return action_cls.model_validate(data), ""
    except ValidationError as e:
        first = e.errors()[0]
        return None, f"{'.'.join(map(str, first['loc'])) or 'action'}: {first['msg']}"[:200]


class OpenEnvTask:
    environment = True
    answers_on_samplers = True  # a sampler plays the episodes: the trainer replays every claim

    def __init__(self, name: str, cls: type, params: dict):
        self.name, self.cls, self.p = name, cls, parse_params(OpenEnvParams, params)
        self.action_cls, self.max_turns = action_class(cls), self.p.max_turns
        self.trusted_observations = self.p.trust_samplers_for_observations
        try:
            self.make()
        except Exception as e:  # noqa: BLE001 - whatever its constructor raises on its arguments
            raise ConfigError(f"task.params.env for {name!r}: {e.__class__.__name__}: {e}") from None
        if not self.trusted_observations:
            check_replayable(self)

    def make(self):
        return self.cls(**self.p.env)

    def _prompt(self, index: int, seed: int) -> Prompt:
        env = self.make()
        try:
            first = show(env.reset(seed=seed))
        finally:
            env.close()
        system = [{"role": "system", "content": self.p.instruction}] if self.p.instruction else []
        return Prompt(index, [*system, {"role": "user", "content": first}], str(seed))

    def prompt(self, index: int) -> Prompt:
        return self._prompt(index, index % HELD_OUT_SEEDS)

    def held_out(self, n: int) -> list[Prompt]:
        return [self._prompt(i, HELD_OUT_SEEDS + i) for i in range(n)]

    def episode(self, prompt: Prompt) -> Played:
        return Played(self, int(prompt.answer))


class Played:
    """One episode: a fresh environment reset with the prompt's seed, stepped with each turn."""

    def __init__(self, task: OpenEnvTask, seed: int):
        self.task, self.env = task, task.make()
        self.env.reset(seed=seed)
        low, high = task.p.reward_range
        # The summed rewards mapped from reward_range onto [0, 1]: each step's scaled, the first
        # carrying -low.
        self.scale, self.offset = high - low, -low

    def _reward(self, reward: float) -> float:
        reward, self.offset = (reward + self.offset) / self.scale, 0.0
        return reward

    def step(self, text: str) -> Step:
        action, why = act(self.task.action_cls, text)
        if action is None:
            return Step([{"role": "user", "content": f"invalid action: {why}"}], self._reward(0.0), done=False)
        observation = self.env.step(action)
        reward = self._reward(float(observation.reward or 0.0))
        if observation.done:
            self.env.close()
            return Step([], reward, done=True)
        return Step([{"role": "user", "content": show(observation)}], reward, done=False)


def check_replayable(task: OpenEnvTask) -> None:
    """Two plays of the first episode with the same turns must answer alike, else no trainer can
    replay what a sampler played."""
    probe = "0" if len(_fields(task.action_cls)) == 1 else "{}"
    plays = []
    for _ in range(2):
        prompt = task.prompt(0)
        episode = task.episode(prompt)
        plays.append([prompt.messages, *(episode.step(probe) for _ in range(min(2, task.max_turns)))])
    if plays[0] != plays[1]:
        raise ConfigError(f"task.name {task.name!r}: two plays of one episode with the same seed and turns answered "
                          "differently, so the trainer cannot replay what a sampler played (randomness not drawn "
                          "from the seed?); task.params.trust_samplers_for_observations = true takes the samplers' "
                          "word for every episode")
