"""`verifiers` environments as echo-rl tasks (the `envs` extra: pip install 'echo-rl[envs]').

    task.name = "verifiers:<module>"     task.params = load_environment's arguments, plus ours (EnvParams)

The module is what `verifiers.load_environment(<module>)` imports (an installed environment
package, e.g. from the Environments Hub, or a module on PYTHONPATH). Its dataset's rows become
the prompts of a dataset task (echo/tasks/dataset.py): the trainer holds them and publishes them,
a sampler never holds an answer, and the environment's eval dataset (else a tenth of the rows,
by hash) is held out. A completion is scored on the trainer, in its budgeted scoring process,
by the environment's own rollout and rubric code (`Environment.run_rollout`) with a client that
replays the completion: the parser's format rules and the rubric's functions and weights apply
exactly as `verifiers` applies them.

The rubric's weighted sum is mapped onto [0, 1], the range every echo-rl reward has: with each
function in [0, 1] (verifiers' convention), the sum lies in [lo, hi] = [sum of the negative
weights, sum of the positive ones], and the reward is (sum - lo) / (hi - lo). GRPO's advantage
(mean-centred, divided by the group's spread) is the same either way; a sum outside [lo, hi] is a
verifier error, counted. A completion is correct, as verifiers' pass@k counts it, when its sum
reaches the environment's `pass_threshold`.

A multi-turn environment (MultiTurnEnv, ToolEnv, StatefulToolEnv) is an echo-rl environment
(echo/tasks/episodes.py): a sampler plays each episode through our episode loop, token in, token
out, and the environment's own rollout code runs alongside, each model call it makes answered
with the turn the model sampled; what it answers (a user's turn, a tool's result) is the
observation. The reward is its rubric's at the episode's end; an episode cut short by echo-rl's
token budget earns 0 (one verifiers never scored). The trainer replays every episode through the
same code and compares every observation (echo/tasks/episodes.py::replay), so a sampler claims
nothing it could invent. Tools are shown to the model in its system message, and the model calls
them as Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (what
Qwen's and SmolLM's templates teach), parsed as vLLM's hermes parser does for verifiers.

Refused at start, in one line: a rubric with group reward functions (they score a group
together), one that calls a judge model (a network service) unless `allow_judge = true`, and a
multi-turn environment whose two plays of one episode with the same turns answer differently
(a service, or randomness without a seed): the trainer could not replay it. Unless the run sets
`trust_samplers_for_observations = true`: then the trainer takes each sampler's observations and
rewards as claimed, and a sampler can train the policy on any episode it likes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from echo.config import ConfigError, cache_dir
from echo.tasks import Prompt, Score, Step, check_rerunnable, parse_params
from echo.tasks.dataset import Dataset
from echo.tasks.loop import on_loop, submit

PREFIX = "verifiers:"
REPLAY_MODEL = "echo-rl"  # the model name the environment sees: the completion is replayed, not generated


class EnvParams(BaseModel):
    """Our keys in task.params; every other key is an argument of the module's load_environment."""

    model_config = ConfigDict(extra="forbid")
    allow_judge: bool = False  # a JudgeRubric calls a model over the network from the trainer's scoring
    max_turns: int = Field(10, ge=1, le=100)  # model turns an episode may take where the environment sets none
    # A multi-turn environment that cannot be replayed (it calls a service, or draws without a seed)
    # trains only with this: the trainer then takes each sampler's observations and rewards on its word.
    trust_samplers_for_observations: bool = False
    # Set by the trainer in the run's config: the SHA-256 (hex) of the published prompts' manifest.
    prompts: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


def task_class(module: str):
    """What echo.tasks.task_class gives for `verifiers:<module>`: the task made from its params."""
    if not module:
        raise ConfigError("task.name 'verifiers:': name the environment's module, e.g. verifiers:my_env")
    return lambda params: make_task(module, params)


def make_task(module: str, params: dict) -> VerifiersEnv:
    """The environment loaded with its arguments and checked; a single-turn one is a plain task,
    a multi-turn one plays episodes."""
    import verifiers as vf

    name = PREFIX + module
    ours = parse_params(EnvParams, {k: v for k, v in params.items() if k in EnvParams.model_fields})
    env = _load(module, {k: v for k, v in params.items() if k not in EnvParams.model_fields})
    check_environment(env, name, ours.allow_judge)
    if isinstance(env, vf.SingleTurnEnv):
        return VerifiersEnv(name, env, ours)
    if env.max_turns <= 0:  # none of its own: ours, so that its stop and our loop's fall on one turn
        env.max_turns = ours.max_turns
    task = VerifiersEpisodes(name, env, ours)
    if not ours.trust_samplers_for_observations:
        calls = [f'<tool_call>{{"name": "{t.name}", "arguments": {{}}}}</tool_call>' for t in env.tool_defs or []]
        check_rerunnable(task, [*calls, "0", "1"][: task.max_turns], "a service, or randomness without a seed")
    return task


def _load(module: str, args: dict):
    import verifiers as vf  # the extra: only where a run names such an environment

    # An Environment takes over SIGINT and SIGTERM as it is made (its handler exits at once, from
    # any await): the worker's own, which stop it in order (a sampler's last heartbeat), are kept.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return vf.load_environment(module, **args)
    except ValueError as e:  # the module did not import
        raise ConfigError(f"task.name {PREFIX + module!r}: {e}") from None
    except (RuntimeError, TypeError) as e:  # its load_environment raised, or took other arguments
        raise ConfigError(f"task.params for {PREFIX + module!r}: {e}") from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _rubrics(rubric) -> list:
    return [rubric, *(r for inner in getattr(rubric, "rubrics", []) for r in _rubrics(inner))]


def check_environment(env, name: str, allow_judge: bool) -> None:
    """What an environment needs that this trainer cannot give it, said at start."""
    import verifiers as vf

    if env.message_type != "chat":
        raise ConfigError(f"task.name {name!r}: a {env.message_type!r} environment; echo-rl's prompts are chat messages")
    if not isinstance(env, vf.MultiTurnEnv):
        raise ConfigError(f"task.name {name!r}: a {type(env).__name__}, which echo-rl does not play; it plays "
                          "SingleTurnEnv, MultiTurnEnv and their kinds (ToolEnv, StatefulToolEnv)")
    if env.rubric.has_group_rewards:
        raise ConfigError(f"task.name {name!r}: its rubric has group reward functions, which score a whole group at "
                          "once; echo-rl scores each completion by itself")
    if not allow_judge and any(isinstance(r, vf.JudgeRubric) for r in _rubrics(env.rubric)):
        raise ConfigError(f"task.name {name!r}: its rubric asks a judge model, a network service the trainer's "
                          "scoring would call for every completion; set task.params.allow_judge = true if it may")


def reward_bounds(weights: list[float], name: str) -> tuple[float, float]:
    """The weighted sum's range when every function gives a value in [0, 1]."""
    lo, hi = sum(min(w, 0.0) for w in weights), sum(max(w, 0.0) for w in weights)
    if hi - lo <= 0:
        raise ConfigError(f"task.name {name!r}: its rubric weighs no reward function: every completion would score "
                          "the same")
    return lo, hi


def _text(content) -> str:
    """A message's content as text (verifiers' own reading: text parts joined)."""
    from verifiers import Parser

    return Parser()._content_to_text(content)


def as_chat(messages) -> list[dict]:
    """Messages as echo-rl keeps them (echo/tasks/dataset.py::row_prompt): role and text."""
    return [{"role": str(m["role"] if isinstance(m, dict) else m.role),
             "content": _text(m["content"] if isinstance(m, dict) else m.content)} for m in messages]


TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""  # Qwen2.5's chat template's words, which SmolLM2's and many others' follow
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def row_messages(env, row: dict) -> list[dict]:
    """A row's prompt as the model sees it: with the environment's tools, if any, described in the
    system message (a chat template's `tools`, which echo-rl's prompts, plain messages, cannot carry)."""
    messages = as_chat(row["prompt"])
    if env.tool_defs:
        tools = TOOLS.format(tools="\n".join(json.dumps({"type": "function", "function": t.model_dump()})
                                             for t in env.tool_defs))
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + tools}
        else:
            messages.insert(0, {"role": "system", "content": tools})
    return messages


def tool_calls(text: str) -> tuple[str, list]:
    """The model's text without its tool-call blocks, and the calls in them (a block that is not a
    call's JSON object stays text), numbered call_0, call_1, ... as a replay must number them
    alike. One pass over the text: it is the sampler's, read in the trainer's scoring budget."""
    from verifiers.types import ToolCall

    calls, kept, at = [], [], 0
    while (start := text.find(OPEN, at)) >= 0 and (end := text.find(CLOSE, start)) >= 0:
        try:
            call = json.loads(text[start + len(OPEN) : end])
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, TypeError, KeyError, AttributeError):  # not a call's JSON object
            kept.append(text[at : end + len(CLOSE)])
        else:
            kept.append(text[at:start])
            calls.append(ToolCall(id=f"call_{len(calls)}", name=str(name),
                                  arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
        at = end + len(CLOSE)
    return ("".join([*kept, text[at:]]).strip() if calls else text), calls


def _rows_file(env, name: str) -> tuple[Path, Path | None]:
    """The environment's training rows and eval rows as JSON Lines in the cache, each file named by
    its content's digest: every process that loads the same environment reads the same files, and
    a dataset task's shards, keyed by file, are built once."""
    folder = cache_dir() / "verifiers"
    folder.mkdir(parents=True, exist_ok=True)

    def write(dataset, split: str) -> Path:
        lines = [orjson.dumps({"prompt": row_messages(env, row), "ref": f"{split}/{i}", "data_source": name})
                 for i, row in enumerate(dataset)]
        data = b"\n".join(lines) + b"\n"
        path = folder / f"{hashlib.sha256(data).hexdigest()[:24]}.jsonl"
        if not path.exists():
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    train = write(env.get_dataset(), "train")
    return train, (write(env.eval_dataset, "eval") if env.build_eval_dataset() is not None else None)


def scripted_client(answer: Callable[[list], Awaitable[str]]):
    """A verifiers client whose model is `answer`: the conversation so far in, the model's text out.
    Where the environment has tools, their calls are read from the text (`tool_calls`)."""
    import verifiers as vf
    from verifiers.types import Response, ResponseMessage

    class Scripted(vf.Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return await answer(prompt), bool(tools)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            text, with_tools = response
            content, calls = tool_calls(text) if with_tools else (text, [])
            message = ResponseMessage(content=content, tool_calls=calls or None, is_truncated=False,
                                      finish_reason="tool_calls" if calls else "stop")
            return Response(id="replay", created=0, model=REPLAY_MODEL, message=message)

        async def close(self):
            return None

    return Scripted(None)


def texts(*answers: str) -> Callable[[list], Awaitable[str]]:
    """A replayed model that gives these answers, in order."""
    left = list(answers)

    async def answer(_conversation: list) -> str:
        return left.pop(0)

    return answer


class VerifiersEnv(Dataset):
    """A dataset task whose rows are a verifiers environment's and whose verifier is its rubric."""

    def __init__(self, name: str, env, params: EnvParams):
        self.env, self.env_params = env, params
        self.lo, self.hi = reward_bounds(env.rubric._get_reward_weights(), name)
        train, held_out = _rows_file(env, name)
        super().__init__({"path": str(train), "val_path": str(held_out) if held_out else None, "prompt": "prompt",
                          "answer": "ref", "data_source": "data_source", "prompts": params.prompts})
        self.name = name
        if params.prompts and hashlib.sha256(self.published_prompts()[0]).hexdigest() != params.prompts:
            raise ConfigError(f"task.name {name!r}: this process loaded other rows than the trainer published: the "
                              "environment's dataset is not the same in every process (a shuffle without a seed?)")

    answer_format = "answer its rubric reads"
    answer_marker = None
    sets_own_format = True  # the environment's system prompt, parser and rubric

    @property
    def held_out_source(self) -> str:
        if self.env.eval_dataset is not None:
            return f"{self.manifest['rows']['held_out']} rows of the environment's eval dataset"
        return (f"{self.manifest['rows']['held_out']} rows held out by a hash of the prompt (a tenth; the environment "
                "has no eval_dataset to hold out)")

    def row(self, prompt: Prompt) -> dict:
        """The environment's own row behind a prompt, checked to be the prompt's."""
        split, _, i = prompt.answer.partition("/")
        row = (self.env.get_dataset() if split == "train" else self.env.eval_dataset)[int(i)]
        if row_messages(self.env, row)[: len(prompt.messages)] != prompt.messages:
            raise ValueError(f"row {prompt.answer} is not the prompt scored: the environment's rows changed")
        return row

    def rollout_reward(self, output) -> float:
        """A finished rollout's reward, on [0, 1] (the module's docstring)."""
        if output.get("error"):
            raise ValueError(f"the environment's rollout failed: {output['error']}")
        return (float(output["reward"]) - self.lo) / (self.hi - self.lo)

    def score(self, completion: str, prompt: Prompt) -> Score:
        output = on_loop(self.env.run_rollout(self.row(prompt), scripted_client(texts(completion)), REPLAY_MODEL, {}))
        parsed = self.env.parser.parse_answer([{"role": "assistant", "content": completion}])
        return Score(self.rollout_reward(output), format_ok=parsed is not None,
                     correct=float(output["reward"]) >= self.env.pass_threshold)


class VerifiersEpisodes(VerifiersEnv):
    """A multi-turn environment's episodes, played by its own rollout code (the module's docstring)."""

    environment = True
    answers_on_samplers = True  # a sampler plays the episodes, so holds the rows: the trainer replays its claims

    def __init__(self, name: str, env, params: EnvParams):
        super().__init__(name, env, params)
        # Every episode our loop ends first (its token budget) stops its rollout with EpisodeOver,
        # which verifiers logs as an error: not one here.
        env.logger.addFilter(lambda record: "EpisodeOver" not in record.getMessage())

    @property
    def max_turns(self) -> int:
        return self.env.max_turns

    @property
    def trusted_observations(self) -> bool:
        """Whether the scorer takes a sampler's episodes as they are (echo/trust/scorer.py)."""
        return self.env_params.trust_samplers_for_observations

    def episode(self, prompt: Prompt) -> Played:
        return Played(self, self.row(prompt))


class EpisodeOver(Exception):
    """What the model's call raises in a rollout whose episode echo-rl ended first."""


class Played:
    """One rollout of the environment, suspended at each model call until `step` gives the turn."""

    def __init__(self, task: VerifiersEpisodes, row: dict):
        self.task = task
        self.seen = on_loop(self._start(row))  # messages in the conversation the model answered last

    async def _start(self, row: dict) -> int:
        # The rollout holds the queues, never this object: dropped, it is collected (__del__).
        asks, turns = self.asks, self.turns = asyncio.Queue(), asyncio.Queue()

        async def answer(conversation: list) -> str:
            await asks.put(conversation)
            if (turn := await turns.get()) is None:
                raise EpisodeOver  # a model error to verifiers: its rollout stops there
            return turn

        self.rollout = asyncio.ensure_future(self.task.env.run_rollout(row, scripted_client(answer), REPLAY_MODEL, {}))
        asked = await self._next()
        if not isinstance(asked, list):
            raise ValueError("the environment ended its episode before the model's first turn")
        return len(asked)

    async def _next(self):
        """The next conversation the rollout asks the model to answer, or its output once over."""
        ask = asyncio.ensure_future(self.asks.get())
        await asyncio.wait({ask, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if ask.done():
            return ask.result()
        ask.cancel()
        return self.rollout.result()

    async def _answer(self, action: str):
        await self.turns.put(action)
        return await self._next()

    def step(self, action: str) -> Step:
        asked = on_loop(self._answer(action))
        if not isinstance(asked, list):  # over: its rubric's reward
            return Step([], self.task.rollout_reward(asked), done=True)
        observation = as_chat(asked[self.seen + 1 :])  # after the model's turn: the environment's answer
        self.seen = len(asked)
        return Step(observation, 0.0, done=False)

    def __del__(self):  # an episode our loop ended first (its token budget): its rollout waits no longer
        rollout = getattr(self, "rollout", None)
        if rollout is not None and not rollout.done():
            submit(_stop, rollout, self.turns)


def _stop(rollout: asyncio.Future, turns: asyncio.Queue) -> None:
    """On the loop: the rollout's next model call ends it, and how it ended is nobody's concern."""
    rollout.add_done_callback(lambda done: done.cancelled() or done.exception())
    turns.put_nowait(None)


# --- the other way: an echo-rl task as a verifiers environment -------------------------------------

def as_environment(task: dict, train: int = 2000, held_out: int = 200):
    """An echo-rl task (`{"name": ..., "params": {...}}`, as in the config) as a verifiers
    SingleTurnEnv, to evaluate it with verifiers' tools: the task's first `train` training prompts
    and `held_out` held-out ones as its dataset and eval dataset, its verifier as the rubric's
    one function (the task's reward, on [0, 1], the answer its verifier reads unchanged)."""
    import verifiers as vf
    from datasets import Dataset as Rows

    from echo.config import TaskConfig
    from echo.tasks import is_environment, load_task

    made = load_task(TaskConfig.model_validate(task))
    if is_environment(made):
        raise ConfigError(f"task {made.name!r} plays episodes: only single-turn tasks export as verifiers environments")

    def rows(prompts: list[Prompt], split: str) -> Rows:
        return Rows.from_list([{"prompt": p.messages, "answer": p.answer,
                                "info": {"index": p.index, "source": p.source, "split": split}} for p in prompts])

    def reward(prompt, completion, answer, info) -> float:
        said = vf.Parser().parse_answer(completion) or ""
        return made.score(said, Prompt(info["index"], as_chat(prompt), answer, info["source"])).reward

    reward.__name__ = made.name.replace(":", "_")  # the metric's name in verifiers' results
    return vf.SingleTurnEnv(dataset=rows([made.prompt(i) for i in range(train)], "train"),
                            eval_dataset=rows(made.held_out(held_out), "held_out"), rubric=vf.Rubric(funcs=[reward]))
