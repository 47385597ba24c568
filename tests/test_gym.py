"""reasoning-gym's generators as tasks (echo/tasks/gym.py): one problem for an index in every
process, the trainer's own rewards, a held-out split apart from training, clear errors, and a
base install without it."""

import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import orjson
import pytest

from bench.gym_base import best_constant
from bench.parity import TASK
from echo.config import ConfigError, SamplingConfig, TaskConfig
from echo.tasks import Score, gym, load_task
from echo.trust.scorer import Scorer
from streams.server import free_port
from tests.groups import TOKENIZER, honest_group

# An arithmetic task, a logic puzzle, a graph task, and a composite of two with our own keys.
HANDFUL = {
    "reasoning_gym:basic_arithmetic": {},
    "reasoning_gym:knights_knaves": {},
    "reasoning_gym:shortest_path": {"min_rows": 4, "max_rows": 6},
    "reasoning_gym:composite": {"format_reward": 0.0, "datasets": [
        {"name": "chain_sum", "weight": 2, "config": {"min_terms": 2, "max_terms": 3}},
        {"name": "largest_island"},
    ]},
}
ROOT = Path(__file__).resolve().parent.parent
# Indices at which every unstable generator differs between hash seeds 1 and 2 (measured over 20
# indices of each generator: codeio differs at 4 of them, list_functions at 3).
PROBED = (0, 500, 2000, 2500)


def right_answer(task, prompt) -> str:
    return f"<answer>{task.problem(prompt)['answer']}</answer>"


def draws(path: str) -> None:
    """What this process derives, written to `path`: each task's first training prompts and a few
    held-out ones with the score of the right answer; every generator's problems at a few indices."""
    out = {}
    for name, params in HANDFUL.items():
        task = load_task(TaskConfig(name=name, params=params))
        prompts = [task.prompt(i) for i in range(12)] + task.held_out(4)
        out[name] = [(p.messages, p.answer, task.score(right_answer(task, p), p).reward) for p in prompts]
    generators = {}
    for name, (dataset_cls, config_cls) in gym.DATASETS.items():
        if name != "composite":
            dataset = dataset_cls(config=config_cls(seed=gym.POOL_SEED, size=gym.POOL_SIZE))
            problems = [(dataset[i]["question"], str(dataset[i]["answer"])) for i in PROBED]
            generators[name] = hashlib.sha256(repr(problems).encode()).hexdigest()
    out["generators"] = generators
    Path(path).write_bytes(orjson.dumps(out))


def draws_in_processes(tmp_path, *hash_seeds: int) -> list[dict]:
    """`draws` in a process for each hash seed, side by side (a process each: the 2 cores)."""
    paths = [tmp_path / f"draws-{seed}.json" for seed in hash_seeds]
    processes = [subprocess.Popen([sys.executable, "-c", f"from tests.test_gym import draws; draws({str(path)!r})"],
                                  cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(seed)}, stdout=subprocess.DEVNULL)
                 for seed, path in zip(hash_seeds, paths)]
    for process in processes:
        assert process.wait(timeout=240) == 0
    return [orjson.loads(path.read_bytes()) for path in paths]


def test_an_index_is_the_same_problem_in_every_process_and_the_unstable_generators_are_refused(tmp_path):
    """A sampler and the trainer are separate processes, each with its own string hashing."""
    a, b = draws_in_processes(tmp_path, 1, 2)
    for name in HANDFUL:
        assert a[name] == b[name], name
        assert all(reward == 1.0 for _, _, reward in a[name]), name  # the ground truth scores full marks
    differ = {name for name in a["generators"] if a["generators"][name] != b["generators"][name]}
    assert differ == gym.UNSTABLE  # exactly the ones refused: the list is measured, not guessed
    for name in gym.UNSTABLE:
        with pytest.raises(ConfigError, match="different problems in different processes"):
            load_task(TaskConfig(name=f"reasoning_gym:{name}"))


COMPOSITE = load_task(TaskConfig(name="reasoning_gym:composite", params=HANDFUL["reasoning_gym:composite"]))


def test_the_trainer_recomputes_the_rewards_with_the_datasets_verifier():
    scorer = Scorer(COMPOSITE, TOKENIZER, vocab_size=len(TOKENIZER),
                      sampling=SamplingConfig(group_size=3, max_new_tokens=64, temperature=1.0))
    sources = set()
    for index in range(8):
        prompt = COMPOSITE.prompt(index)
        sources.add(prompt.answer.split("/")[0])
        right = right_answer(COMPOSITE, prompt)
        liar = honest_group(index, [right, "<answer>no</answer>", right.removeprefix("<answer>")], of_task=COMPOSITE,
                            rewards=[0.0, 1.0, 1.0])
        assert scorer.malformed(liar) is None
        scored = scorer.score(liar)
        assert scored.reason is None and scored.reward_mismatch
        assert scored.rewards == [1.0, 0.0, 0.0]  # format_reward 0: a wrong or untagged answer earns nothing
    assert sources == {"chain_sum", "largest_island"}  # both of the composite's generators
    other = honest_group(1, ["a", "b", "c"], of_task=COMPOSITE, rewards=[0.0] * 3)
    assert scorer.score(other.model_copy(update={"prompt_index": 2})).reason == "prompt_mismatch"


def test_an_answer_the_verifier_cannot_read_is_wrong_not_a_verifier_error():
    """prime_factorization's verifier raises on `2 × 3 = 6` (int('3 = 6')): the model's fault."""
    task = load_task(TaskConfig(name="reasoning_gym:prime_factorization", params={"max_value": 50}))
    prompt = task.prompt(0)
    assert task.score("<answer>2 × 3 = 6</answer>", prompt) == Score(0.1, format_ok=True, correct=False)
    assert task.score(right_answer(task, prompt), prompt).correct


def test_one_fixed_answer_gets_most_of_gcd_right_and_little_of_the_parity_study_task():
    """Why the parity study left gcd: "1" answers 0.56 of its held-out problems (numbers up to 40),
    above SmolLM2's 0.22, so RL can learn to guess; on the study's lcm no answer gets 0.1."""
    gcd = load_task(TaskConfig(name="reasoning_gym:gcd", params={"max_value": 40}))
    answer, share = best_constant(gcd, gcd.held_out(160))
    assert answer == "1" and share > 0.5
    study = load_task(TaskConfig(**TASK))
    assert best_constant(study, study.held_out(160))[1] < 0.1


@pytest.mark.parametrize("size", [60, gym.POOL_SIZE])
def test_the_held_out_split_never_meets_training(size):
    task = load_task(TaskConfig(name="reasoning_gym:chain_sum", params={"size": size}))
    training = {task.prompt(i).messages[-1]["content"] for i in range(1500)}
    held_out = [p.messages[-1]["content"] for p in task.held_out(50)]
    assert held_out and not training & set(held_out)
    if size == 60:  # training drew every problem of the small pool that it may: the split, not luck
        pool = {gym.INSTRUCTION.format(question=task.entry("chain_sum", i)["question"]) for i in range(size)}
        assert training | set(held_out) == pool


@pytest.mark.parametrize(
    "name, params, said",
    [
        ("reasoning_gym:chain_summ", {}, "reasoning-gym has no dataset 'chain_summ'; did you mean chain_sum"),
        ("reasoning_gym:composite", {}, "task.params.datasets: reasoning_gym:composite needs at least one"),
        ("reasoning_gym:chain_sum", {"min_termz": 2}, "task.params.min_termz: not an option of chain_sum"),
        ("reasoning_gym:chain_sum", {"min_terms": 5, "max_terms": 2}, r"task.params \(chain_sum\)"),
        ("reasoning_gym:chain_sum", {"format_reward": 2}, "task.params.format_reward"),
        # Its validate() lets this through; drawing a problem fails: said at start, not in the sampler.
        ("reasoning_gym:simple_equations", {"operators": ["+", "-"]}, r"task.params \(simple_equations\): ValueError"),
        ("reasoning_gym:chain_sum", {"datasets": [{"name": "gcd"}]}, "only for reasoning_gym:composite"),
        ("reasoning_gym:composite", {"datasets": [{"name": "gcd"}, {"name": "lcm", "config": {"max_valu": 3}}]},
         "task.params.datasets.1.config.max_valu: not an option of lcm"),
        ("reasoning_gym:composite", {"datasets": [{"name": "gcd"}], "min_value": 3},
         "a composite's generators take their options in datasets"),
        ("reasoning_gym:composite", {"datasets": [{"name": "gcd"}, {"name": "gcd"}]}, "a dataset is named twice"),
        # A path would put a file of the sampler's machine into the prompts it publishes.
        ("reasoning_gym:spell_backward", {"data_file": "/etc/passwd"}, "not one of reasoning-gym's data files"),
        ("reasoning_gym:spell_backward", {"data_file": "../../../etc/passwd"}, "not one of reasoning-gym's data files"),
    ],
)
def test_a_bad_dataset_or_option_is_said_naming_the_field(name, params, said):
    with pytest.raises(ConfigError, match=said):
        load_task(TaskConfig(name=name, params=params))


def test_without_the_extra_a_sampler_says_which_to_install_in_one_line():
    """As on an edge box with the base install: reasoning-gym cannot be imported."""
    closed = f"nats://127.0.0.1:{free_port()}"
    script = ("import sys; sys.modules['reasoning_gym'] = None; from workers.cli import main; "
              f"sys.exit(main(['sampler', '--id', 's1', '--nats', {closed!r}, '--run-id', 'x', "
              "'--task', 'reasoning_gym:chain_sum']))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "needs reasoning-gym, an extra the base install leaves out: pip install 'echo-rl[tasks]'" in err


def test_the_base_install_leaves_reasoning_gym_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("reasoning" in r for r in project["dependencies"])
    assert any(r.startswith("reasoning-gym") for r in project["optional-dependencies"]["tasks"])
    assert "tasks" in (ROOT / "Makefile").read_text().split("-e '.[", 1)[1].split("]")[0].split(",")
