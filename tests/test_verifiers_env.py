"""`verifiers` environments as tasks (echo/tasks/verifiers_env.py), with the real `verifiers`
package (the `envs` extra): rows, held-out rows and scores as the library gives them, and what
the trainer cannot run refused at start in one line. The swarm that trains on one: test_e2e.py."""

from __future__ import annotations

import asyncio
import gc
import re
import signal
import subprocess
import sys

import pytest

from bench.envs import GUESS_ENV
from echo.config import ConfigError, TaskConfig
from echo.model.loading import encode_chat
from echo.tasks import is_environment, load_task, safe_score, task_class
from echo.tasks.episodes import EpisodeBuilder, rerun
from echo.tasks.loop import on_loop
from echo.tasks.verifiers_env import as_chat, scripted_client, texts, tool_calls
from echo.trust.scorer import Scorer
from tests.groups import SAMPLING, TOKENIZER, honest_group
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


def library_rewards(env, row: dict, answers: list[str]) -> dict[str, float]:
    """What verifiers' own group rollout and rubric (score_group, where we score each completion by
    score_rollout) give each text as the model's answer to `row`."""
    outputs = asyncio.run(env.run_group([row] * len(answers), scripted_client(texts(*answers)), "m", {}))
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
    answers = ["<answer>6</answer>", "<answer>\n6\n</answer>", "<answer>7</answer>", "<answer>SIX</answer>",
             "It is 6", "", "<answer>6</answer> LOUD"]
    theirs = library_rewards(task.env, task.env.get_dataset()[3], answers)
    assert len(set(theirs.values())) >= 4  # the rubric tells these apart
    lo, hi = task.lo, task.hi
    assert (lo, hi) == (0.0, 1.5)  # the weights' sum: each function in [0, 1]
    for text in answers:
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


# --- multi-turn: played by the samplers' episode loop, replayed by the trainer ---------------------

CALCULATOR_ENV = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 30):
    """A ToolEnv with a calculator: the model adds with the tool, then answers."""
    rows = [{"question": f"What is {i} + {2 * i + 1}? Use the add tool.", "answer": str(3 * i + 1)} for i in range(n)]
    parser = vf.XMLParser(["answer"])

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def correct_answer(completion, answer) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    return vf.ToolEnv(tools=[add], max_turns=3, dataset=Dataset.from_list(rows), parser=parser,
                      system_prompt="Answer inside <answer></answer>.",
                      rubric=vf.Rubric(funcs=[correct_answer], parser=parser))
'''


def played(task, index: int, turns: list[str], max_tokens: int = 4096):
    prompt = task.prompt(index)
    episode = EpisodeBuilder(task, TOKENIZER, prompt, encode_chat(TOKENIZER, prompt.messages), max_tokens)
    for text in turns:
        assert not episode.done
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        episode.add_turn(ids, [-0.5] * len(ids))
    return prompt, episode


def test_a_tool_environment_is_played_turn_by_turn_as_verifiers_rolls_it_out(env_module):
    task = load_task(TaskConfig(name=f"verifiers:{env_module('calculator_env', CALCULATOR_ENV)}", params={}))
    assert is_environment(task) and task.max_turns == 3
    system = task.prompt(4).messages[0]["content"]
    assert system.startswith("Answer inside") and '"name": "add"' in system and "<tool_call>" in system
    a, b = map(int, re.findall(r"\d+", task.prompt(4).messages[-1]["content"]))
    call, answer = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>', f"<answer>{a + b}</answer>"
    prompt, episode = played(task, 4, [call, answer])
    completion = episode.completion()
    assert episode.done and completion.claimed_reward == 1.0 and len(completion.observations) == 1
    seen = completion.token_ids[completion.observations[0].at:][:completion.observations[0].tokens]
    assert TOKENIZER.decode(seen.tolist()) == f"\n<|im_start|>tool\n{a + b}<|im_end|>\n<|im_start|>assistant\n"
    # verifiers' own rollout, given the same turns, answers the same and scores the same.
    output = asyncio.run(task.env.run_rollout(task.row(prompt), scripted_client(texts(call, answer)), "m", {}))
    said = [m["content"] for m in as_chat(output["completion"]) if m["role"] == "tool"]
    assert said == [str(a + b)] and output["reward"] == 1.0
    assert rerun(task, TOKENIZER, prompt, completion, 4096) == (1.0, None)
    # A sampler that claims the tool said another number.
    ids = completion.token_ids.copy()
    ids[completion.observations[0].at + 7] ^= 1
    assert rerun(task, TOKENIZER, prompt, completion.replaced(token_ids=ids), 4096).reason == "observation_mismatch"


def test_a_sampler_lying_about_an_episode_is_refused_or_struck_by_the_scorer(env_module):
    task = load_task(TaskConfig(name=f"verifiers:{env_module('guess_env', GUESS_ENV)}", params={}))
    scorer = Scorer(task, TOKENIZER, vocab_size=len(TOKENIZER), sampling=SAMPLING)
    _, right = played(task, 4, ["<answer>2</answer>", "<answer>5</answer>"])  # the number is 5
    _, wrong = played(task, 4, ["<answer>9</answer>", "<answer>8</answer>"], max_tokens=60)  # cut by its budget
    assert right.done and right.reward == 1.0 and wrong.done and wrong.reward == 0.0
    assert "'2': higher" in TOKENIZER.decode(right.completion().token_ids.tolist())

    def group(*completions):
        return honest_group(4, texts=["x"] * len(completions), rewards=[0.0] * len(completions), of_task=task,
                            completions=list(completions), temperature=SAMPLING.temperature)

    honest = scorer.score(group(right.completion(), wrong.completion()))
    assert honest.reason is None and honest.rewards == [1.0, 0.0] and not honest.reward_mismatch
    lied = scorer.score(group(right.completion(), wrong.completion().replaced(claimed_reward=1.0)))
    assert lied.reward_mismatch and lied.rewards == [1.0, 0.0]  # a strike; trained on the replayed reward
    # The rollout of an episode our loop ended first (its budget) ends once the episode is dropped.
    rollout = wrong.episode.rollout
    del wrong
    gc.collect()
    assert on_loop(asyncio.wait_for(rollout, None))["error"] is not None
    ids = right.completion().token_ids.copy()
    said = TOKENIZER.decode(ids.tolist()).index("higher")
    ids[said - 20: said + 6] = TOKENIZER("'5': lower", add_special_tokens=False)["input_ids"][:1] * 26
    assert scorer.score(group(right.completion().replaced(token_ids=ids))).reason == "observation_mismatch"


def test_an_environment_that_answers_differently_each_play_is_refused_at_start(env_module):
    name = env_module("guess_env", GUESS_ENV)
    with pytest.raises(ConfigError, match="answered differently") as refused:
        load_task(TaskConfig(name=f"verifiers:{name}", params={"seeded": False}))
    assert "\n" not in str(refused.value)


def test_loading_an_environment_leaves_the_workers_signal_handlers_as_they_were(env_module):
    """verifiers' Environment sets SIGINT and SIGTERM handlers that exit at once: a sampler so
    stopped sent no last heartbeat."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    load_task(TaskConfig(name=f"verifiers:{env_module('sums_env', VERIFIERS_ENV)}", params={"n": 20}))
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_an_echo_task_exported_as_a_verifiers_environment_scores_as_the_task_does(tmp_path, monkeypatch):
    """`echo-rl export-env` writes a module verifiers loads; its own group rollout gives each answer
    the task's reward."""
    done = subprocess.run([sys.executable, "-m", "workers.cli", "export-env", "--out", str(tmp_path / "math_env.py"),
                           "--train", "30", "--held-out", "5", "task.params.levels=[1]"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    env = vf.load_environment("math_env")
    math = load_task(TaskConfig(name="math", params={"levels": [1]}))
    prompt = math.prompt(7)
    assert env.get_dataset()[7]["prompt"] == prompt.messages and len(env.get_eval_dataset()) == 5
    answers = [f"\\boxed{{{prompt.answer}}}", "\\boxed{-1}", "no box"]
    theirs = library_rewards(env, env.get_dataset()[7], answers)
    assert theirs == {a: math.score(a, prompt).reward for a in answers} and theirs[answers[0]] == 1.0


def test_an_environment_that_cannot_be_replayed_is_refused_at_start_unless_the_run_trusts_the_samplers(env_module):
    with pytest.raises(ConfigError, match="cannot replay what a sampler played"):
        load_task(TaskConfig(name=f"verifiers:{env_module('guess_env', GUESS_ENV)}",
                             params={"seeded": False, "max_turns": 2}))


def test_an_environment_that_cannot_be_replayed_trains_on_the_samplers_word_where_the_run_says_so(env_module):
    task = load_task(TaskConfig(name=f"verifiers:{env_module('guess_env', GUESS_ENV)}",
                                params={"seeded": False, "trust_samplers_for_observations": True, "max_turns": 2}))
    scorer = Scorer(task, TOKENIZER, vocab_size=len(TOKENIZER), sampling=SAMPLING)
    _, episode = played(task, 4, ["<answer>3</answer>", "<answer>4</answer>"])
    assert episode.done and len(episode.completion().observations) == 1  # its observation: a random number
    claimed = episode.completion().replaced(claimed_reward=0.75)
    scored = scorer.score(honest_group(4, texts=["x"], rewards=[0.0], of_task=task, completions=[claimed],
                                        temperature=SAMPLING.temperature))
    assert scored.reason is None and scored.rewards == [0.75] and not scored.reward_mismatch  # taken as claimed
    # What it still checks: the turn limit.
    three = played(load_task(TaskConfig(name="verifiers:guess_env", params={
        "seeded": False, "trust_samplers_for_observations": True, "max_turns": 3})), 4, ["1", "2", "3"])[1]
    scored = scorer.score(honest_group(4, texts=["x"], rewards=[0.0], of_task=task, completions=[three.completion()],
                                        temperature=SAMPLING.temperature))
    assert scored.reason == "too_many_turns"


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "", [("add", '{"a": 1}')]),
    ('first <tool_call>\n{"name": "a", "arguments": "{}"}\n</tool_call> then <tool_call>[1]</tool_call> end',
     "first  then <tool_call>[1]</tool_call> end", [("a", "{}")]),
    ("<tool_call>" * 10_000 + "no close", "<tool_call>" * 10_000 + "no close", []),  # one pass, not quadratic
    ("plain text", "plain text", []),
])
def test_tool_calls_are_read_from_the_models_text_as_hermes_blocks(text, content, calls):
    said, parsed = tool_calls(text)
    assert said == content and [(c.name, c.arguments) for c in parsed] == calls
    assert [c.id for c in parsed] == [f"call_{i}" for i in range(len(calls))]
