"""`verifiers` environments as tasks (echo/tasks/verifiers_env.py), with the real `verifiers`
package (the `envs` extra): rows, held-out rows and scores as the library gives them, and what
the trainer cannot run refused at start in one line. The swarm that trains on one: test_e2e.py."""

from __future__ import annotations

import asyncio
import sys

import pytest

from echo.config import ConfigError, TaskConfig
from echo.tasks import load_task, safe_score, task_class
from echo.tasks.verifiers_env import replay_client
from tests.swarms import VERIFIERS_ENV

vf = pytest.importorskip("verifiers")


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """Write `source` as an importable module of this name; its task loaded from its params."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))

    def write(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(source)
        sys.modules.pop(name, None)
        return name

    return write


def library_rewards(env, row: dict, texts: list[str]) -> dict[str, float]:
    """What verifiers' own group rollout and rubric (score_group, where we score each completion by
    score_rollout) give each text as the model's answer to `row`."""
    outputs = asyncio.run(env.run_group([row] * len(texts), replay_client(texts), "m", {}))
    return {out["completion"][-1]["content"]: out["reward"] for out in outputs}


def test_a_verifiers_environment_gives_its_rows_and_scores_each_completion_as_the_library_does(env_module):
    name = env_module("sums_env", VERIFIERS_ENV)
    task = load_task(TaskConfig(name=f"verifiers:{name}", params={"n": 40, "eval_n": 5}))
    prompt = task.prompt(3)
    assert prompt.messages == [{"role": "system", "content": "Answer inside <answer></answer>."},
                               {"role": "user", "content": "What is 3 + 3?"}]
    assert task.prompt(43).messages == prompt.messages  # the index wraps over the training rows
    # Held out: the environment's eval dataset, never a training row.
    held_out = task.held_out(10)
    assert [p.messages[-1]["content"] for p in held_out] == [f"What is {i} + {i % 7}?" for i in range(40, 45)]
    texts = ["<answer>6</answer>", "<answer>\n6\n</answer>", "<answer>7</answer>", "<answer>SIX</answer>",
             "It is 6", "", "<answer>6</answer> LOUD"]
    theirs = library_rewards(task.env, task.env.get_dataset()[3], texts)
    assert len(set(theirs.values())) >= 4  # the rubric tells these apart
    lo, hi = task.lo, task.hi
    assert (lo, hi) == (0.0, 1.5)  # the weights' sum: each function in [0, 1]
    for text in texts:
        score = safe_score(task, text, prompt)
        assert score is not None and 0 <= score.reward <= 1
        assert lo + score.reward * (hi - lo) == pytest.approx(theirs[text], abs=1e-12), text
        assert score.correct == (theirs[text] >= task.env.pass_threshold)  # verifiers' pass@k's "correct"
        assert score.format_ok == (task.env.parser.parse_answer([{"role": "assistant", "content": text}]) is not None)
    assert safe_score(task, "<answer>6</answer>", prompt).correct and not safe_score(task, "It is 6", prompt).correct
    # An eval row is scored against its own answer.
    assert safe_score(task, "<answer>45</answer>", held_out[0]).reward > safe_score(task, "<answer>6</answer>",
                                                                                     held_out[0]).reward


def test_scoring_from_a_running_event_loop_gives_the_same_score(env_module):
    """The trainer's evaluation scores from its event loop's thread: the rubric runs on its own."""
    task = load_task(TaskConfig(name=f"verifiers:{env_module('sums_env', VERIFIERS_ENV)}", params={"n": 20}))

    async def scored():
        return task.score("<answer>6</answer>", task.prompt(3))

    assert asyncio.run(scored()) == task.score("<answer>6</answer>", task.prompt(3))


def test_a_row_that_is_not_the_prompt_scored_is_a_verifier_error(env_module):
    task = load_task(TaskConfig(name=f"verifiers:{env_module('sums_env', VERIFIERS_ENV)}", params={"n": 20}))
    prompt = task.prompt(3)
    other = type(prompt)(prompt.index, prompt.messages, "train/4", prompt.source)
    assert safe_score(task, "<answer>6</answer>", other) is None


MULTI_TURN = '''
import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def load_environment():
    return Guess(dataset=Dataset.from_list([{"question": "guess", "answer": "1"}]), max_turns=3)
'''

GROUP_REWARD = '''
import verifiers as vf
from datasets import Dataset


def load_environment():
    def longest(completions) -> list[float]:
        return [1.0] * len(completions)

    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]),
                            rubric=vf.Rubric(funcs=[longest]))
'''

JUDGED = '''
import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI


def load_environment():
    judge = vf.JudgeRubric(judge_client=AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1:9"))

    async def judged(judge, prompt, completion, answer, state) -> float:
        return float("yes" in (await judge(prompt, completion, answer, state)).lower())

    judge.add_reward_func(judged)
    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]), rubric=judge)
'''

UNWEIGHTED = '''
import verifiers as vf
from datasets import Dataset


def load_environment():
    def anything(completion) -> float:
        return 1.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]),
                            rubric=vf.Rubric(funcs=[anything], weights=[0.0]))
'''


@pytest.mark.parametrize("source, params, said", [
    (MULTI_TURN, {}, "Guess is multi-turn"),
    (GROUP_REWARD, {}, "group reward functions"),
    (JUDGED, {}, "task.params.allow_judge = true"),
    (UNWEIGHTED, {}, "weighs no reward function"),
    (VERIFIERS_ENV, {"size": 3}, "task.params for 'verifiers:refused_env'"),  # load_environment takes no `size`
    (VERIFIERS_ENV, {"allow_judge": "sometimes"}, "task.params.allow_judge"),
])
def test_what_the_trainer_cannot_run_is_refused_at_start_in_one_line(env_module, source, params, said):
    name = env_module("refused_env", source)
    with pytest.raises(ConfigError, match=None) as refused:
        load_task(TaskConfig(name=f"verifiers:{name}", params=params))
    assert said in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_a_judged_environment_loads_where_the_run_allows_it(env_module):
    task = load_task(TaskConfig(name=f"verifiers:{env_module('judged_env', JUDGED)}", params={"allow_judge": True}))
    assert task.prompt(0).messages[-1]["content"] == "q"


def test_an_environment_module_that_is_not_there_is_named(env_module):
    with pytest.raises(ConfigError, match="verifiers:no_such_env"):
        task_class("verifiers:no_such_env")({})
    with pytest.raises(ConfigError, match="name the environment's module"):
        task_class("verifiers:")
