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

Refused at start, in one line: a rubric with group reward functions (they score a group
together), one that calls a judge model (a network service) unless `allow_judge = true`, and a
multi-turn environment (not yet played by the samplers' episode loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from echo.config import ConfigError, cache_dir
from echo.tasks import Prompt, Score, parse_params
from echo.tasks.dataset import Dataset

PREFIX = "verifiers:"
REPLAY_MODEL = "echo-rl"  # the model name the environment sees: the completion is replayed, not generated


class EnvParams(BaseModel):
    """Our keys in task.params; every other key is an argument of the module's load_environment."""

    model_config = ConfigDict(extra="forbid")
    allow_judge: bool = False  # a JudgeRubric calls a model over the network from the trainer's scoring
    # Set by the trainer in the run's config: the SHA-256 (hex) of the published prompts' manifest.
    prompts: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


def task_class(module: str):
    """What echo.tasks.task_class gives for `verifiers:<module>`: the task made from its params."""
    if not module:
        raise ConfigError("task.name 'verifiers:': name the environment's module, e.g. verifiers:my_env")
    return lambda params: VerifiersEnv(module, params)


def _load(module: str, args: dict):
    import verifiers as vf  # the extra: only where a run names such an environment

    try:
        return vf.load_environment(module, **args)
    except ValueError as e:  # the module did not import
        raise ConfigError(f"task.name {PREFIX + module!r}: {e}") from None
    except (RuntimeError, TypeError) as e:  # its load_environment raised, or took other arguments
        raise ConfigError(f"task.params for {PREFIX + module!r}: {e}") from None


def _rubrics(rubric) -> list:
    return [rubric, *(r for inner in getattr(rubric, "rubrics", []) for r in _rubrics(inner))]


def check_environment(env, name: str, allow_judge: bool) -> None:
    """What an environment needs that this trainer cannot give it, said at start."""
    import verifiers as vf

    if env.message_type != "chat":
        raise ConfigError(f"task.name {name!r}: a {env.message_type!r} environment; echo-rl's prompts are chat messages")
    if not isinstance(env, vf.SingleTurnEnv):
        raise ConfigError(f"task.name {name!r}: {type(env).__name__} is multi-turn, which echo-rl does not play from "
                          "verifiers yet; single-turn environments (SingleTurnEnv) train")
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


def _chat(messages) -> list[dict]:
    """Messages as echo-rl keeps them (echo/tasks/dataset.py::row_prompt): role and text."""
    return [{"role": str(m.get("role", "user")), "content": m.get("content")} for m in messages]


def _rows_file(env, name: str) -> tuple[Path, Path | None]:
    """The environment's training rows and eval rows as JSON Lines in the cache, each file named by
    its content's digest: every process that loads the same environment reads the same files, and
    a dataset task's shards, keyed by file, are built once."""
    folder = cache_dir() / "verifiers"
    folder.mkdir(parents=True, exist_ok=True)

    def write(dataset, split: str) -> Path:
        lines = [orjson.dumps({"prompt": _chat(row["prompt"]), "ref": f"{split}/{i}", "data_source": name})
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


def _run(coroutine):
    """A coroutine run to its end from sync code: on this thread, or where this thread already runs
    an event loop (the trainer's evaluation), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(coroutine)))
    thread.start()
    thread.join()
    return result[0]


def replay_client(texts: list[str]):
    """A verifiers client that answers the environment's model calls with `texts`, in order."""
    import verifiers as vf
    from verifiers.types import Response, ResponseMessage

    left = list(texts)

    class Replay(vf.Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return left.pop(0)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            message = ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
            return Response(id="replay", created=0, model=REPLAY_MODEL, message=message)

        async def close(self):
            return None

    return Replay(None)


class VerifiersEnv(Dataset):
    """A dataset task whose rows are a verifiers environment's and whose verifier is its rubric."""

    def __init__(self, module: str, params: dict):
        name = PREFIX + module
        ours = {k: v for k, v in params.items() if k in EnvParams.model_fields}
        self.env_params = parse_params(EnvParams, ours)
        self.env = _load(module, {k: v for k, v in params.items() if k not in ours})
        check_environment(self.env, name, self.env_params.allow_judge)
        self.lo, self.hi = reward_bounds(self.env.rubric._get_reward_weights(), name)
        train, held_out = _rows_file(self.env, name)
        super().__init__({"path": str(train), "val_path": str(held_out) if held_out else None, "prompt": "prompt",
                          "answer": "ref", "data_source": "data_source", "prompts": self.env_params.prompts})
        self.name = name
        published = hashlib.sha256(self.published_prompts()[0]).hexdigest()
        if self.env_params.prompts and published != self.env_params.prompts:
            raise ConfigError(f"task.name {name!r}: this process loaded other rows than the trainer published: the "
                              "environment's dataset is not the same in every process (a shuffle without a seed?)")

    answer_format = "answer its rubric reads"

    def rubric_reward(self, completion: str, prompt: Prompt) -> tuple[float, dict]:
        """The environment's own reward and metrics for `completion`, by its rollout and rubric."""
        split, _, i = prompt.answer.partition("/")
        row = (self.env.get_dataset() if split == "train" else self.env.eval_dataset)[int(i)]
        if _chat(row["prompt"])[: len(prompt.messages)] != prompt.messages:
            raise ValueError(f"row {prompt.answer} is not the prompt scored: the environment's rows changed")
        output = _run(self.env.run_rollout(row, replay_client([completion]), REPLAY_MODEL, {}))
        if output.get("error"):
            raise ValueError(f"the environment's rollout failed: {output['error']}")
        return float(output["reward"]), dict(output.get("metrics") or {})

    def score(self, completion: str, prompt: Prompt) -> Score:
        reward, _ = self.rubric_reward(completion, prompt)
        parsed = self.env.parser.parse_answer([{"role": "assistant", "content": completion}])
        return Score((reward - self.lo) / (self.hi - self.lo), format_ok=parsed is not None,
                     correct=reward >= self.env.pass_threshold)
