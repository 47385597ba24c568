"""OpenEnv environments as echo-rl environments (echo/tasks/openenv_env.py), with the real
`openenv-core` package: an environment the test writes to its interface, played and replayed as
a sampler and the trainer do, against OpenEnv's own server code for the same actions."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from echo.config import ConfigError, TaskConfig
from echo.model.loading import encode_chat
from echo.tasks import is_environment, load_task
from echo.tasks.episodes import EpisodeBuilder, rerun
from echo.trust.scorer import Scorer
from tests.groups import SAMPLING, TOKENIZER, honest_group
from tests.swarms import OPENENV_GUESS

pytest.importorskip("openenv.core.env_server.interfaces")


@pytest.fixture
def guess_module(tmp_path, monkeypatch):
    (tmp_path / "guess_openenv.py").write_text(OPENENV_GUESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("guess_openenv", None)
    return "guess_openenv"


def played(task, prompt, turns: list[str], max_tokens: int = 4096) -> EpisodeBuilder:
    episode = EpisodeBuilder(task, TOKENIZER, prompt, encode_chat(TOKENIZER, prompt.messages), max_tokens)
    for text in turns:
        if episode.done:
            break
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        episode.add_turn(ids, [-0.5] * len(ids))
    return episode


def secret_of(task, prompt) -> int:
    """The number, found as a model would: by guessing."""
    for guess in range(1, 10):
        if task.episode(prompt).step(str(guess)).done:
            return guess
    raise AssertionError("no guess was right")


def test_an_openenv_environment_plays_from_a_seed_and_the_trainer_replays_it(guess_module):
    task = load_task(TaskConfig(name=f"openenv:{guess_module}", params={"max_turns": 4}))
    assert is_environment(task) and task.max_turns == 4
    prompt = task.prompt(5)
    assert prompt.messages == [{"role": "user", "content": "Guess my number, 1 to 9."}] and prompt.answer == "5"
    assert [p.answer for p in task.held_out(3)] == [str(2**31 + i) for i in range(3)]  # seeds no training index has
    secret = secret_of(task, prompt)
    wrong = "1" if secret != 1 else "2"
    episode = played(task, prompt, [wrong, str(secret)])
    completion = episode.completion()
    assert episode.done and completion.claimed_reward == 1.0 and len(completion.observations) == 1
    seen = completion.token_ids[completion.observations[0].at:][:completion.observations[0].tokens]
    assert TOKENIZER.decode(seen.tolist()).startswith(f"\n<|im_start|>user\n'{wrong}': ")
    assert rerun(task, TOKENIZER, prompt, completion, 4096) == (1.0, None)
    ids = completion.token_ids.copy()
    ids[completion.observations[0].at + 9] ^= 1  # another answer than the environment's
    assert rerun(task, TOKENIZER, prompt, completion.replaced(token_ids=ids), 4096).reason == "observation_mismatch"
    scorer = Scorer(task, TOKENIZER, vocab_size=len(TOKENIZER), sampling=SAMPLING)
    lied = scorer.score(honest_group(5, texts=["x"], rewards=[0.0], of_task=task,
                                      completions=[played(task, prompt, [wrong] * 4).completion().replaced(claimed_reward=1.0)],
                                      temperature=SAMPLING.temperature))
    assert lied.reward_mismatch and lied.rewards == [0.0]  # a strike; trained on the replayed reward


def test_the_episode_is_what_openenvs_own_server_gives_for_the_same_actions(guess_module):
    """OpenEnv's server (its FastAPI app, over its WebSocket session) reset with the seed and
    stepped with the model's turns answers what the in-process episode answered."""
    import guess_openenv
    from fastapi.testclient import TestClient
    from openenv.core.env_server.http_server import create_fastapi_app

    task = load_task(TaskConfig(name=f"openenv:{guess_module}", params={}))
    prompt = task.prompt(11)
    turns = ["3", "7", str(secret_of(task, prompt))]
    ours = task.episode(prompt)
    app = create_fastapi_app(guess_openenv.GuessEnvironment, guess_openenv.GuessAction, guess_openenv.GuessObservation)
    with TestClient(app).websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"seed": 11}})
        assert ws.receive_json()["data"]["observation"]["message"] == prompt.messages[-1]["content"]
        for turn in turns:
            step = ours.step(turn)
            ws.send_json({"type": "step", "data": {"guess": turn}})
            theirs = ws.receive_json()["data"]
            assert step.done == theirs["done"] and step.reward == theirs["reward"]
            assert step.done or step.observation == [{"role": "user", "content": theirs["observation"]["message"]}]


def test_served_by_openenvs_own_server_in_a_subprocess_the_episodes_are_the_in_process_ones(guess_module, tmp_path):
    """`server = "subprocess"`: OpenEnv's server for the class, under uvicorn beside the process,
    played through OpenEnv's client, a WebSocket session an episode; several at once, as a
    sampler plays a group. The server ends with the process that started it."""
    ours = load_task(TaskConfig(name=f"openenv:{guess_module}", params={"max_turns": 4}))
    served = load_task(TaskConfig(name=f"openenv:{guess_module}", params={"server": "subprocess", "max_turns": 4}))
    prompts = [served.prompt(i) for i in (3, 11, 12)]
    assert prompts == [ours.prompt(i) for i in (3, 11, 12)]
    turns = ["not a number", str(secret_of(ours, prompts[0])), "7", "3"]
    theirs = [played(served, p, turns) for p in prompts]  # three sessions open at once
    assert [e.completion() for e in theirs] == [played(ours, p, turns).completion() for p in prompts]
    assert any(e.done and e.reward == 1.0 for e in theirs) and any(e.completion().observations for e in theirs)
    completion = theirs[0].completion()
    assert rerun(served, TOKENIZER, prompts[0], completion, 4096) == rerun(ours, TOKENIZER, prompts[0], completion, 4096)
    ids = completion.token_ids.copy()
    ids[completion.observations[0].at + 9] ^= 1
    assert rerun(served, TOKENIZER, prompts[0], completion.replaced(token_ids=ids), 4096).reason == "observation_mismatch"
    # A process that served: its server goes when it does.
    script = (f"import sys, psutil; sys.path.insert(0, {str(tmp_path)!r}); from echo.config import TaskConfig; "
              "from echo.tasks import load_task; "
              f"load_task(TaskConfig(name='openenv:{guess_module}', params={{'server': 'subprocess'}})); "
              "print(*[c.pid for c in psutil.Process().children()])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    children = [int(pid) for pid in done.stdout.split()]
    assert len(children) == 1
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in children if psutil.pid_exists(pid)], timeout=30)
    assert not alive


def test_a_turn_that_is_not_an_action_is_answered_and_the_summed_reward_mapped_onto_0_1(guess_module):
    task = load_task(TaskConfig(name=f"openenv:{guess_module}:GuessEnvironment",
                                params={"reward_range": [-1.0, 1.0], "instruction": "Answer with a number."}))
    prompt = task.prompt(3)
    assert prompt.messages[0] == {"role": "system", "content": "Answer with a number."}
    episode = task.episode(prompt)
    assert episode.step("   ").observation[0]["content"].startswith("'': ")  # an empty guess is still a guess
    assert played(task, prompt, [str(secret_of(task, prompt))]).reward == 1.0  # 1 on [-1, 1]
    assert played(task, prompt, ["0"] * 8).reward == 0.5  # 0 on [-1, 1]


@pytest.mark.parametrize("name, params, said", [
    ("openenv:{m}", {"env": {"seeded": False}}, "answered differently"),
    ("openenv:{m}", {"env": {"colour": "red"}}, "task.params.env for"),
    ("openenv:{m}:Nope", {}, "has no OpenEnv Environment Nope"),
    ("openenv:no_such_openenv_module", {}, "no_such_openenv_module"),
    ("openenv:{m}", {"reward_range": [1, 0]}, "reward_range"),
])
def test_what_cannot_be_played_or_replayed_is_refused_at_start_in_one_line(guess_module, name, params, said):
    with pytest.raises(ConfigError) as refused:
        load_task(TaskConfig(name=name.format(m=guess_module), params=params))
    assert said in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_a_server_that_cannot_serve_a_group_or_an_image_without_docker_is_refused_in_one_line(guess_module,
                                                                                              monkeypatch):
    import guess_openenv

    monkeypatch.setattr(guess_openenv.GuessEnvironment, "SUPPORTS_CONCURRENT_SESSIONS", False)
    with pytest.raises(ConfigError, match="does not declare SUPPORTS_CONCURRENT_SESSIONS") as refused:
        load_task(TaskConfig(name=f"openenv:{guess_module}", params={"server": "subprocess"}))
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("PATH", "")  # no docker client, as on a machine without Docker
    with pytest.raises(ConfigError, match="its container did not start") as refused:
        load_task(TaskConfig(name="openenv:docker:guess-env:latest", params={}))
    assert "\n" not in str(refused.value)


def test_an_unseeded_environment_is_refused_at_start_unless_the_run_trusts_the_samplers(guess_module):
    with pytest.raises(ConfigError, match="cannot replay what a sampler played") as refused:
        load_task(TaskConfig(name=f"openenv:{guess_module}", params={"env": {"seeded": False}}))
    assert "\n" not in str(refused.value)


def test_an_unseeded_environment_trains_on_the_samplers_word_where_the_run_says_so(guess_module):
    task = load_task(TaskConfig(name=f"openenv:{guess_module}", params={
        "env": {"seeded": False}, "trust_samplers_for_observations": True}))
    assert task.trusted_observations and task.prompt(0).messages


SERVER = """
from openenv.core.env_server.http_server import create_app

from guess_openenv import GuessAction, GuessEnvironment, GuessObservation

app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
"""


@pytest.mark.compose
@pytest.mark.timeout(3600)  # the image installs openenv-core (vfs, a busy 2-core box: minutes)
def test_a_docker_image_of_openenvs_server_plays_the_episodes_the_package_plays_in_process(guess_module, tmp_path):
    """`openenv:docker:<image>` where Docker runs (make test-compose): an image of OpenEnv's server
    for the game, as OpenEnv's docs build one, started by OpenEnv's LocalDockerProvider, its Action
    read from its /schema, played through OpenEnv's client: the in-process episodes."""
    import importlib.metadata

    image = "echo-rl-test/openenv-guess:latest"
    folder = tmp_path / "image"
    folder.mkdir()
    (folder / "guess_openenv.py").write_text(OPENENV_GUESS)
    (folder / "server.py").write_text(SERVER)
    (folder / "Dockerfile").write_text(
        f"FROM {os.environ.get('PYTHON_IMAGE', 'python:3.11-slim')}\n"
        f"RUN pip install -q openenv-core=={importlib.metadata.version('openenv-core')}\n"
        "COPY *.py /app/\nWORKDIR /app\n"
        'CMD ["python", "-m", "uvicorn", "server:app", "--host", "0.0.0.0", "--port", "8000"]\n')
    subprocess.run(["docker", "build", "-q", "-t", image, str(folder)], check=True, capture_output=True, timeout=3000)
    try:
        ours = load_task(TaskConfig(name=f"openenv:{guess_module}", params={"max_turns": 4}))
        theirs = load_task(TaskConfig(name=f"openenv:docker:{image}", params={"max_turns": 4}))
        prompts = [theirs.prompt(i) for i in (3, 11)]
        assert prompts == [ours.prompt(i) for i in (3, 11)]
        turns = ["not a number", str(secret_of(ours, prompts[0])), "7", "3"]
        played_there = [played(theirs, p, turns) for p in prompts]
        assert [e.completion() for e in played_there] == [played(ours, p, turns).completion() for p in prompts]
        assert played_there[0].reward == 1.0
    finally:  # its container goes when this process does; the image's GBs (vfs) now
        subprocess.run(["docker", "image", "rm", "--force", image], capture_output=True, check=False)

