"""OpenEnv environments as echo-rl environments (the `envs` extra: pip install 'echo-rl[envs]').

    task.name = "openenv:<module>"            the one OpenEnv Environment class the module defines
    task.name = "openenv:<module>:<Class>"    or the one named
    task.name = "openenv:docker:<image>"      OpenEnv's server from a Docker image
    task.params = {env = {...its constructor's arguments}, server, max_turns, reward_range, instruction}

Every process that plays or replays an episode runs the environment next to it, the ways OpenEnv
documents: in-process (`server = "in-process"`, the default: a fresh instance for each episode),
as OpenEnv's own server in a subprocess on a loopback port (`server = "subprocess"`: the class
served by `create_app` under uvicorn; the class must declare SUPPORTS_CONCURRENT_SESSIONS, as a
sampler plays a group's episodes at once), or from a Docker image (`openenv:docker:<image>`, where
Docker is: OpenEnv's LocalDockerProvider starts one container a process). A server is played
through OpenEnv's client, a WebSocket session for each episode, and stopped when the process ends.

A prompt index is a seed: the prompt is the observation `reset(seed=index)` gives (after
`instruction`, a system message, if set), and held-out prompts are seeds of their own range,
never a training index. The model's turn becomes the environment's Action: the text itself where
the Action has one text field, else the JSON object in the text; one the environment refuses is
answered "invalid action: ..." as a user turn, and the episode goes on. Each observation is
shown as a user turn: its one text field, else its fields as JSON (done, reward and metadata left
out). The rewards of an episode's steps are summed and mapped from `reward_range` onto [0, 1].

The trainer replays each episode with the sampler's turns (echo/tasks/episodes.py::replay), so an
environment must answer alike for a seed and the same actions: two plays are compared at start
and one that differs is refused, unless `trust_samplers_for_observations = true` (the trainer
then takes the samplers' word: docs/operations.md).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.config import ConfigError
from echo.tasks import Prompt, Step, check_rerunnable, parse_params
from echo.tasks.loop import on_loop, submit

PREFIX = "openenv:"
DOCKER = "docker:"  # openenv:docker:<image>
HELD_OUT_SEEDS = 2**31  # held-out episodes reset with seeds from here; training indices stay below
TEXT_FIELDS_SHOWN = ("done", "reward", "metadata")  # an observation's fields the model is not shown
SERVER_START_S = 120.0  # a server that does not answer by then is refused at start (an image may pull)


class OpenEnvParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env: dict = {}  # the environment class's constructor arguments
    server: Literal["in-process", "subprocess"] = "in-process"  # where a class runs (an image runs in Docker)
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
    """What echo.tasks.task_class gives for `openenv:<module>[:<Class>]` or `openenv:docker:<image>`."""
    if name.startswith(DOCKER):
        if not (image := name.removeprefix(DOCKER)):
            raise ConfigError("task.name 'openenv:docker:': name the image, e.g. openenv:docker:echo-env:latest")
        return lambda params: OpenEnvTask(PREFIX + name, None, params, image=image)
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


def declared_types(cls: type) -> tuple[type, type]:
    """The Action and Observation types the environment is declared with (Environment[Action, Observation, State])."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Environment:
                action, observation = typing.get_args(base)[:2]
                if inspect.isclass(action) and issubclass(action, Action) and issubclass(observation, Observation):
                    return action, observation
    raise ConfigError(f"{cls.__name__}: declare it as Environment[YourAction, YourObservation, State], so that "
                      "echo-rl knows which Action a model's turn becomes")


def shown(fields: dict) -> str:
    """An observation's fields (done, reward and metadata left out) as the model sees them: its one
    text field, else the fields as JSON."""
    fields = {k: v for k, v in fields.items() if k not in TEXT_FIELDS_SHOWN}
    if len(fields) == 1 and isinstance(value := next(iter(fields.values())), str):
        return value
    return json.dumps(fields, sort_keys=True, default=str)


@dataclass(frozen=True)
class ActionForm:
    """How a model's text becomes the Action, read from the Action's JSON schema (the class's, or
    a server's /schema)."""

    fields: tuple[str, ...]
    text: bool  # one field, a string: the text is it

    @classmethod
    def of(cls, schema: dict) -> ActionForm:
        fields = {k: v for k, v in schema.get("properties", {}).items() if k not in TEXT_FIELDS_SHOWN}
        return cls(tuple(fields), len(fields) == 1 and next(iter(fields.values())).get("type") == "string")

    def data(self, text: str) -> tuple[dict | None, str]:
        """The Action's fields from the text, or why there are none."""
        if self.text:
            return {self.fields[0]: text.strip()}, ""
        start, end = text.find("{"), text.rfind("}")
        try:
            data = json.loads(text[start : end + 1]) if 0 <= start < end else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return None, f"give the action as a JSON object with {', '.join(self.fields)}"
        return data, ""


class Refused(Exception):
    """The environment would not take the action: said to the model, the episode goes on."""


class InProcess:
    """An episode on an instance of the class, made here."""

    def __init__(self, task: OpenEnvTask):
        self.env, self.action_cls = task.make(), task.action_cls

    def reset(self, seed: int) -> str:
        return shown(self.env.reset(seed=seed).model_dump())

    def step(self, data: dict) -> tuple[str, float, bool]:
        try:
            action = self.action_cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            raise Refused(f"{'.'.join(map(str, first['loc'])) or 'action'}: {first['msg']}") from None
        observation = self.env.step(action)
        return shown(observation.model_dump()), float(observation.reward or 0.0), bool(observation.done)

    def close(self) -> None:
        self.env.close()


class OverWebSocket:
    """An episode in a session of an OpenEnv server, through OpenEnv's own client."""

    def __init__(self, url: str):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(url)
        on_loop(self.client.connect())

    def reset(self, seed: int) -> str:
        return shown(on_loop(self.client.reset(seed=seed)).observation)

    def step(self, data: dict) -> tuple[str, float, bool]:
        try:
            result = on_loop(self.client.step(data))
        except RuntimeError as e:  # the server's answer to an action it refused: the session goes on
            raise Refused(str(e).removeprefix("Server error: ")) from None
        return shown(result.observation), float(result.reward or 0.0), bool(result.done)

    def close(self) -> None:
        on_loop(self.client.disconnect())


# --- servers beside this process ---------------------------------------------------------------

# Its log is left out: OpenEnv's server logs a traceback for each session its client closes (it
# closes the socket again), and what goes wrong in a step comes back to the client as its answer.
SERVE = """
import json, socket, sys
import uvicorn
from echo.process.lifeline import die_with_parent
from echo.tasks.openenv_env import app_for
die_with_parent()
app = app_for(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="critical")).run(sockets=[sock])
"""


def app_for(module_name: str, class_name: str, env_args: dict):
    """OpenEnv's server for the class (what its docs run under uvicorn): a session for each episode."""
    from openenv.core.env_server.http_server import create_app

    cls = environment_class(module_name, class_name)
    action, observation = declared_types(cls)
    return create_app(lambda: cls(**env_args), action, observation, max_concurrent_envs=1024)


@dataclass
class Server:
    url: str
    stop: typing.Callable[[], None]
    pid: int  # the process it serves: a forked child starts its own


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def server_for(task: OpenEnvTask) -> str:
    """The URL of this process's server for the task, started the first time it is asked for."""
    key = json.dumps([task.name, task.p.env], sort_keys=True, default=str)
    with _servers_lock:
        running = _servers.get(key)
        if running is None or running.pid != os.getpid():
            url, stop = _start_container(task.image) if task.image else _start_subprocess(task)
            running = _servers[key] = Server(url, stop, os.getpid())
            atexit.register(lambda: running.pid == os.getpid() and running.stop())
    return running.url


def _start_subprocess(task: OpenEnvTask) -> tuple[str, typing.Callable[[], None]]:
    module_name, class_name = task.cls.__module__, task.cls.__name__
    path = os.pathsep.join(p for p in sys.path if p)  # it imports the class from where this process did
    child = subprocess.Popen([sys.executable, "-c", SERVE, module_name, class_name, json.dumps(task.p.env)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
    port = child.stdout.readline().strip()  # the child's first line: its port, or nothing if it died
    if not port.isdigit():
        child.kill()
        raise ConfigError(f"task.params.server for {task.name!r}: its server did not start (exit {child.wait()})")
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, task.name)

    def stop() -> None:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()

    return url, stop


def _start_container(image: str) -> tuple[str, typing.Callable[[], None]]:
    from openenv.core.containers.runtime.providers import LocalDockerProvider

    try:
        provider = LocalDockerProvider()
        url = provider.start_container(image)
        provider.wait_for_ready(url, timeout_s=SERVER_START_S)
    except Exception as e:  # noqa: BLE001 - no Docker, no image, a container that never answered
        raise ConfigError(f"task.name {PREFIX + DOCKER + image!r}: its container did not start: {e}") from None
    return url, provider.stop_container


def _wait_ready(url: str, name: str) -> None:
    """Until its /health answers (the child printed its port before uvicorn listens on it)."""
    deadline = time.monotonic() + SERVER_START_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ConfigError(f"task.params.server for {name!r}: its server did not answer within "
                                  f"{SERVER_START_S:.0f} s") from None
            time.sleep(0.05)


def _schema(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/schema", timeout=30) as answer:
        return json.loads(answer.read())["action"]


class OpenEnvTask:
    environment = True
    answers_on_samplers = True  # a sampler plays the episodes: the trainer replays every claim

    def __init__(self, name: str, cls: type | None, params: dict, image: str = ""):
        self.name, self.cls, self.image, self.p = name, cls, image, parse_params(OpenEnvParams, params)
        self.max_turns, self.trusted_observations = self.p.max_turns, self.p.trust_samplers_for_observations
        if image and ("env" in params or "server" in params):
            raise ConfigError(f"task.params for {name!r}: an image's server takes neither env nor server")
        self.action_cls = declared_types(cls)[0] if cls else None
        if cls and self.p.server == "subprocess" and not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
            raise ConfigError(f"task.params.server for {name!r}: one server holds a group's episodes at once, and "
                              f"{cls.__name__} does not declare SUPPORTS_CONCURRENT_SESSIONS = True; play it in-process")
        if cls and self.p.server == "in-process":
            try:
                self.make()
            except Exception as e:  # noqa: BLE001 - whatever its constructor raises on its arguments
                raise ConfigError(f"task.params.env for {name!r}: {e.__class__.__name__}: {e}") from None
            self.form = ActionForm.of(self.action_cls.model_json_schema())
        else:
            self.form = ActionForm.of(_schema(server_for(self)))
        if not self.trusted_observations:
            probe = "0" if self.form.text else "{}"
            check_rerunnable(self, [probe] * min(2, self.max_turns), "randomness not drawn from the seed?")

    def make(self):
        return self.cls(**self.p.env)

    def session(self) -> InProcess | OverWebSocket:
        return InProcess(self) if self.cls and self.p.server == "in-process" else OverWebSocket(server_for(self))

    def _prompt(self, index: int, seed: int) -> Prompt:
        session = self.session()
        try:
            first = session.reset(seed)
        finally:
            session.close()
        system = [{"role": "system", "content": self.p.instruction}] if self.p.instruction else []
        return Prompt(index, [*system, {"role": "user", "content": first}], str(seed))

    def prompt(self, index: int) -> Prompt:
        return self._prompt(index, index % HELD_OUT_SEEDS)

    def held_out(self, n: int) -> list[Prompt]:
        return [self._prompt(i, HELD_OUT_SEEDS + i) for i in range(n)]

    def episode(self, prompt: Prompt) -> Played:
        return Played(self, int(prompt.answer))


class Played:
    """One episode: a fresh session reset with the prompt's seed, stepped with each turn."""

    def __init__(self, task: OpenEnvTask, seed: int):
        self.task, self.session = task, task.session()
        self.session.reset(seed)
        low, high = task.p.reward_range
        # The summed rewards mapped from reward_range onto [0, 1]: each step's scaled, the first
        # carrying -low.
        self.scale, self.offset = high - low, -low

    def _reward(self, reward: float) -> float:
        reward, self.offset = (reward + self.offset) / self.scale, 0.0
        return reward

    def step(self, text: str) -> Step:
        data, why = self.task.form.data(text)
        try:
            if data is None:
                raise Refused(why)
            observation, reward, done = self.session.step(data)
        except Refused as e:
            return Step([{"role": "user", "content": f"invalid action: {str(e)[:200]}"}], self._reward(0.0), done=False)
        if done:
            self.session.close()
            return Step([], self._reward(reward), done=True)
        return Step([{"role": "user", "content": observation}], self._reward(reward), done=False)

    def __del__(self):  # an episode our loop ended first (its token budget): its session ends
        session = getattr(self, "session", None)
        if isinstance(session, OverWebSocket):
            submit(_disconnect, session.client)


def _disconnect(client) -> None:
    """On the loop, from a finaliser: the session's end is not waited for."""
    asyncio.ensure_future(client.disconnect())
