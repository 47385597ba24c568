"""reasoning-gym's procedural generators as echo-rl tasks (the `tasks` extra: pip install 'echo-rl[tasks]').

    task.name = "reasoning_gym:chain_sum"      task.params = the generator's config (difficulty, sizes)
    task.name = "reasoning_gym:composite"      task.params.datasets = [{name, weight, config}, ...]

plus two keys of ours in task.params: `format_reward` and `example` (below). A problem is a pair
(dataset, index into its pool of `size` problems) drawn from a generator seeded by the prompt
index, so a sampler and the trainer derive the same question and verifier input from the index
alone. The model answers inside <answer></answer>; the dataset's own verifier scores the text
there. Held out, as for every generated task: the problems whose question hashes into the
evaluation tenth (echo/tasks::is_held_out), never a training prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import io
import random

from pydantic import BaseModel, ConfigDict, Field
from reasoning_gym.data import get_data_file_path
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from echo.config import ConfigError
from echo.tasks import GYM, GeneratedTask, Prompt, Score, is_held_out, parse_params

PREFIX = GYM
INSTRUCTION = "{question}\nPut the final answer inside <answer></answer>."
POOL_SIZE = 10_000  # problems a dataset's indices range over unless task.params sets `size`
POOL_SEED = 0  # its seed unless task.params sets `seed`: a problem depends on the task's config only

# Generators whose problems depend on Python's per-process string hashing (set and dict order of
# strings), so a sampler and the trainer would see different problems for one index: measured for
# reasoning-gym 0.1.25 in two processes with different PYTHONHASHSEED, 20 indices of each
# generator (tests/test_gym.py keeps checking 4). One missed here costs groups, not training: the
# trainer refuses a group whose prompt is not its own (prompt_mismatch).
UNSTABLE = frozenset({"codeio", "isomorphic_strings", "knight_swap", "list_functions", "polynomial_multiplication",
                      "ransom_note", "word_ladder"})


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float = Field(1.0, gt=0)
    config: dict = {}


class GymParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_reward: float = Field(0.1, ge=0, le=1)  # an answer in the tags that the verifier scores lower
    example: bool = True  # show one solved problem of the same dataset, in the answer format, first
    datasets: list[DatasetSpec] = []  # reasoning_gym:composite only


def check_dataset(name: str, task_name: str) -> None:
    """A clear error for a dataset reasoning-gym lacks, or one that cannot be shared between processes."""
    if name == "composite" and task_name == PREFIX + "composite":
        return
    if name not in DATASETS or name == "composite":
        close = difflib.get_close_matches(name, [d for d in DATASETS if d != "composite"], n=4)
        hint = f"did you mean {' or '.join(close)}?" if close else f"it has {', '.join(sorted(DATASETS))}"
        raise ConfigError(f"task.name {task_name!r}: reasoning-gym has no dataset {name!r}; {hint}")
    if name in UNSTABLE:
        raise ConfigError(f"task.name {task_name!r}: reasoning-gym's {name} draws different problems in different "
                          "processes (its generator follows Python's string hashing), so a sampler's prompt would "
                          "not be the trainer's; pick another dataset")


def task_class(dataset: str):
    """What echo.tasks.task_class gives for `reasoning_gym:<dataset>`: the task made from its params."""
    check_dataset(dataset, PREFIX + dataset)
    return functools.partial(ReasoningGym, dataset)


def draw(generator, index: int) -> dict:
    """One problem. bf prints as it generates: not into a worker's output."""
    with contextlib.redirect_stdout(io.StringIO()):
        return generator[index]


def make_generator(name: str, config: dict, where: str):
    """reasoning-gym's dataset `name` with `config`, its errors said as config errors at `where`."""
    check_dataset(name, PREFIX + name)
    dataset_cls, config_cls = DATASETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ConfigError(f"invalid config: {where}{unknown[0]}: not an option of {name} "
                          f"(it has {', '.join(sorted(fields))})")
    for key, value in config.items():
        # A file option names one of reasoning-gym's own data files: a path would let a run's
        # config put a file of the sampler's machine into the prompts it publishes.
        if key.endswith("_file") and not (isinstance(value, str) and "/" not in value and "\\" not in value
                                          and get_data_file_path(value).is_file()):
            raise ConfigError(f"invalid config: {where}{key}: {value!r} is not one of reasoning-gym's data files")
    defaults = {"size": POOL_SIZE, "seed": POOL_SEED}
    config = {**{k: v for k, v in defaults.items() if k in fields}, **config}
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
        generator = dataset_cls(config=made)
        draw(generator, 0)  # options its validate() lets through may still fail to draw a problem
        return generator
    except Exception as e:  # noqa: BLE001 - whatever a generator raises on its options is a config error
        said = f"{e.__class__.__name__}: {e}" if str(e) else f"{e.__class__.__name__} from its config check"
        raise ConfigError(f"invalid config: {where.rstrip('.')} ({name}): {said}") from None


class ReasoningGym(GeneratedTask):
    def __init__(self, dataset: str, params: dict):
        self.name = PREFIX + dataset
        theirs = {k: v for k, v in params.items() if k not in GymParams.model_fields}  # the generator's
        self.p = parse_params(GymParams, {k: v for k, v in params.items() if k not in theirs})
        if dataset != "composite":
            if self.p.datasets:
                raise ConfigError(f"invalid config: task.params.datasets: only for reasoning_gym:composite, not {self.name}")
            self.generators = {dataset: make_generator(dataset, theirs, "task.params.")}
            self.weights = [1.0]
        else:
            if not self.p.datasets:
                raise ConfigError("invalid config: task.params.datasets: reasoning_gym:composite needs at least one")
            if theirs:
                raise ConfigError(f"invalid config: task.params.{min(theirs)}: a composite's generators take their "
                                  "options in datasets[].config")
            if len({s.name for s in self.p.datasets}) != len(self.p.datasets):
                raise ConfigError("invalid config: task.params.datasets: a dataset is named twice")
            self.generators = {s.name: make_generator(s.name, s.config, f"task.params.datasets.{i}.config.")
                               for i, s in enumerate(self.p.datasets)}
            self.weights = [s.weight for s in self.p.datasets]
        self.entry = functools.lru_cache(maxsize=4096)(self._entry)  # prompt() then score(): one draw

    def _entry(self, dataset: str, index: int) -> dict:
        return draw(self.generators[dataset], index)

    def _messages(self, dataset: str, index: int) -> list[dict]:
        entry = self.entry(dataset, index)
        question = {"role": "user", "content": INSTRUCTION.format(question=entry["question"])}
        return [*(self.example(dataset) if self.p.example else []), question]

    @functools.cache
    def example(self, dataset: str) -> list[dict]:
        """The first training-side problem of the dataset, solved: the answer format by example."""
        for index in range(len(self.generators[dataset])):
            entry = self.entry(dataset, index)
            question = {"role": "user", "content": INSTRUCTION.format(question=entry["question"])}
            if not is_held_out([question]):
                return [question, {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]
        return []

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        dataset = rng.choices(list(self.generators), weights=self.weights)[0]
        index = rng.randrange(len(self.generators[dataset]))
        # The "answer" is where the problem lies: its verifier needs the whole entry (metadata too).
        return self._messages(dataset, index), f"{dataset}/{index}"

    def problem(self, prompt: Prompt) -> dict:
        """The generator's entry behind a prompt: question, answer and what its verifier reads."""
        dataset, index = prompt.answer.rsplit("/", 1)
        return self.entry(dataset, int(index))

    answer_format = "<answer></answer> block"
    sets_own_format = True  # reasoning-gym's own prompt and verifier

    def score(self, completion: str, prompt: Prompt) -> Score:
        answer = extract_answer(completion)
        if answer is None:
            return Score(0.0, format_ok=False, correct=False)
        dataset = prompt.answer.rsplit("/", 1)[0]
        try:
            verdict = float(self.generators[dataset].score_answer(answer, self.problem(prompt)))
        except Exception:  # noqa: BLE001 - some verifiers raise on an answer they cannot read: a wrong one
            verdict = 0.0
        if verdict >= 1.0:
            return Score(1.0, format_ok=True, correct=True)
        return Score(max(verdict, self.p.format_reward), format_ok=True, correct=False)
