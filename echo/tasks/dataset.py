"""A user's dataset, named once on the trainer: JSON Lines, a JSON array, parquet, or a folder a
`datasets` Dataset was saved to (`save_to_disk`), in verl's schema (`prompt` as chat messages,
`reward_model.ground_truth`, `data_source`), TRL's (`prompt` or `messages`, an answer column) or
columns named in `task.params`. No I/O but the dataset's own files and their cache.

The file is read once, a batch of rows at a time, into shards of SHARD_ROWS rows under the
cache (echo-rl's, `ECHO_CACHE`): the prompts (chat messages, what samplers need) apart from the
answers (what only the trainer reads). Every process of the trainer reads the shards it needs,
a few at a time, so memory stays bounded for a file of millions of rows. The trainer publishes
the prompt shards to the run's object store, addressed by digest (streams/prompts.py): a sampler
reads the prompt it was granted from there, and never holds an answer. Rewards are the trainer's
alone: a sampler claims none.

    task.name = "dataset"
    task.params = {path = "data/train.parquet", reward = "math"}   # every key: DatasetParams
"""

from __future__ import annotations

import hashlib
import heapq
import importlib
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from echo.config import ConfigError, cache_dir
from echo.tasks import Prompt, Score, is_held_out, parse_params
from echo.tasks.files import existing, read_rows
from echo.tasks.math import MAX_ANSWER_CHARS, boxed, final_answer, math_score

SHARD_ROWS = 1024  # prompts a shard holds: what a sampler fetches to read one
SHARDS_KEPT = 8  # shards a process keeps in memory, most recently read
# What a sampler fetches at most for a published manifest, and for a shard (1024 prompts of up to
# 32k tokens): checked before a byte is allocated.
PROMPTS_MANIFEST_MAX_BYTES = 16 << 20
PROMPT_SHARD_MAX_BYTES = 256 << 20
LONGEST_KEPT = 16  # the longest prompts, by bytes, that the trainer encodes to check against the context
PROMPT_COLUMNS = ("prompt", "messages", "question", "problem")  # looked for in this order
ANSWER_COLUMNS = ("reward_model.ground_truth", "answer", "solution", "ground_truth")
SPLITS = ("train", "held_out")
HELD_OUT_NAMES = ("test", "val", "validation", "eval")  # a split column's values that hold a row out


class DatasetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # On the trainer: the file, or a `save_to_disk` folder. Samplers never read it (`prompts`).
    path: str | None = None
    prompt: str | None = None  # its column (a.b for a nested field): chat messages or text; None: looked for
    answer: str | None = None  # the ground truth's column; None: looked for (verl's reward_model.ground_truth first)
    data_source: str = "data_source"  # the column naming each row's source (reasoning_gym's verifier reads it)
    split: str = "train"  # a saved DatasetDict's split
    # Held-out rows, for evaluation (run.eval_prompts, run.eval_every): a validation file of the
    # same form (verl's data.val_files, TRL's eval_dataset; val_split: a saved DatasetDict's); else
    # the rows whose split_column says test, val, validation or eval (verl's extra_info.split); else
    # a tenth of the rows, chosen by a hash of the prompt.
    val_path: str | None = None
    val_split: str = "test"
    split_column: str = "extra_info.split"
    # A text prompt becomes one user message: this, with {prompt} filled in; a chat prompt's last
    # user turn is filled in the same way (verl's and TRL's chat rows carry no answer format).
    instruction: str = Field("{prompt}", pattern=r"\{prompt\}")
    # Worked examples, each [question, solution], put before every prompt as a user turn (the
    # instruction applied) and the assistant's: a small model that does not follow the answer's form
    # zero-shot copies it from them (the built-in math task shows one: echo/tasks/math.py's EXAMPLE).
    examples: list[tuple[str, str]] = Field([], max_length=8)
    # math: the last \boxed{} against the truth (numbers compared, else math-verify); exact: the last
    # \boxed{} (or the whole text) equal to the truth; regex:<pattern>: its last match's first group
    # equal to it; reasoning_gym: the verifier of the row's data_source; or module:function(completion,
    # truth, data_source) -> float in [0, 1].
    reward: str = "math"
    format_reward: float = Field(0.1, ge=0, le=1)  # math, exact, regex: an answer found but wrong
    # Set by the trainer in the run's config: the SHA-256 (hex) of the published prompts' manifest.
    prompts: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


# --- rows to prompts ----------------------------------------------------------------------------

def _field(row: dict, column: str):
    for key in column.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def pick_columns(row: dict, p: DatasetParams) -> tuple[str, str]:
    """The prompt and answer columns: as named, or the first of the usual names the row has."""
    found = []
    for given, usual, what in ((p.prompt, PROMPT_COLUMNS, "prompt"), (p.answer, ANSWER_COLUMNS, "answer")):
        names = (given,) if given else usual
        column = next((c for c in names if _field(row, c) is not None), None)
        if column is None:
            looked = f"no column {given!r}" if given else f"no {what} column (looked for {', '.join(usual)})"
            raise ConfigError(f"task.params.{what}: {p.path} has {looked}; its columns: {', '.join(sorted(row))}")
        found.append(column)
    return found[0], found[1]


def fill(instruction: str, prompt: str) -> str:
    """The instruction with the prompt in it. Its braces as written (`\\boxed{}`), or doubled as
    str.format has them (`\\boxed{{}}`): both give one pair (formatting raised on the first)."""
    return instruction.replace("{{", "{").replace("}}", "}").replace("{prompt}", prompt)


def row_prompt(row: dict, prompt_column: str, answer_column: str, p: DatasetParams) -> tuple[list[dict], str, str] | str:
    """(messages, answer, data source) of a row, or why it is skipped."""
    value, answer = _field(row, prompt_column), _field(row, answer_column)
    if isinstance(value, str):
        messages = [{"role": "user", "content": fill(p.instruction, value)}]
    elif isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        messages = [{"role": str(m.get("role", "user")), "content": m["content"]} for m in value]
        while messages and messages[-1]["role"] == "assistant":  # TRL's `messages` end with the answer
            messages.pop()
        last_user = next((i for i in reversed(range(len(messages))) if messages[i]["role"] == "user"), None)
        if last_user is not None:
            messages[last_user]["content"] = fill(p.instruction, messages[last_user]["content"])
    else:
        return "prompt_not_text_or_messages"
    if not messages or not messages[-1]["content"].strip():
        return "empty_prompt"
    shown = [turn for question, solution in p.examples
             for turn in ({"role": "user", "content": fill(p.instruction, question)},
                          {"role": "assistant", "content": solution})]
    system = 1 if messages[0]["role"] == "system" else 0  # the examples after a system prompt, if any
    messages = [*messages[:system], *shown, *messages[system:]]
    if answer is None or str(answer).strip() == "":
        return "no_answer"
    return messages, str(answer), str(_field(row, p.data_source) or "")


# --- the shards, built once ---------------------------------------------------------------------

def built_dataset(p: DatasetParams) -> Path:
    """The cache folder of `p.path`'s shards, built on first use (atomically: a rename)."""
    source = existing(p.path).resolve()
    mapping = p.model_dump(include={"prompt", "answer", "data_source", "split", "instruction", "examples",
                                    "val_split", "split_column"})
    validation = existing(p.val_path, "task.params.val_path").resolve() if p.val_path else None
    files = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in (source, validation) if f is not None]
    key = hashlib.sha256(orjson.dumps([files, mapping],
                                      option=orjson.OPT_SORT_KEYS)).hexdigest()[:20]
    target = cache_dir() / "datasets" / key
    if (target / "manifest.json").exists():
        return target
    tmp = target.with_name(f"{key}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build(p, tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "manifest.json").exists():  # not another process that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(p: DatasetParams, folder: Path) -> None:
    rows, skipped, columns = {s: 0 for s in SPLITS}, Counter(), None
    longest: list[tuple[int, int, list[dict]]] = []  # (bytes, row number in the file, messages): a heap
    pending: dict[str, list[tuple[bytes, bytes]]] = {s: [] for s in SPLITS}
    shards: dict[str, list[str]] = {s: [] for s in SPLITS}

    def flush(split: str) -> None:
        prompts = b"".join(line for line, _ in pending[split])
        name = f"{split}-{len(shards[split]):06d}"
        (folder / f"{name}.prompts").write_bytes(prompts)
        (folder / f"{name}.answers").write_bytes(b"".join(answer for _, answer in pending[split]))
        shards[split].append(hashlib.sha256(prompts).hexdigest())
        pending[split].clear()

    number, held_out_by = 0, Counter()
    for row, held_out_file in _rows(p):
        number += 1
        columns = columns or pick_columns(row, p)
        made = row_prompt(row, *columns, p)
        if isinstance(made, str):
            skipped[made] += 1
            continue
        messages, answer, source = made
        split, why = row_split(row, messages, p, held_out_file)
        held_out_by[why] += split == "held_out"
        line = orjson.dumps({"messages": messages, "data_source": source}) + b"\n"
        (heapq.heappush if len(longest) < LONGEST_KEPT else heapq.heappushpop)(longest, (len(line), number, messages))
        pending[split].append((line, orjson.dumps(answer) + b"\n"))
        rows[split] += 1
        if len(pending[split]) == SHARD_ROWS:
            flush(split)
    for split in SPLITS:
        if pending[split]:
            flush(split)
    if rows["train"] == 0:
        why = f" ({sum(skipped.values())} rows skipped: {dict(skipped)})" if skipped else ""
        raise ConfigError(f"task.params.path {p.path}: no training rows{why}")
    manifest = {"rows": rows, "shard_rows": SHARD_ROWS, "shards": shards, "skipped": dict(skipped),
                "held_out_by": {why: n for why, n in held_out_by.items() if n},
                "columns": {"prompt": columns[0], "answer": columns[1]},
                "longest": [{"row": n, "messages": m} for _, n, m in sorted(longest, reverse=True)]}
    (folder / "manifest.json").write_bytes(orjson.dumps(manifest))


def _rows(p: DatasetParams) -> Iterator[tuple[dict, bool]]:
    """Every row of the training file, then of the validation file (True: held out, all of it)."""
    for batch in read_rows(p.path, p.split):
        yield from ((row, False) for row in batch)
    if p.val_path:
        for batch in read_rows(p.val_path, p.val_split, "task.params.val_path"):
            yield from ((row, True) for row in batch)


def row_split(row: dict, messages: list[dict], p: DatasetParams, held_out_file: bool) -> tuple[str, str]:
    """Which split a row is in, and by what: the validation file, the row's split column, or the
    hash of its prompt (only where neither says)."""
    if p.val_path:
        return ("held_out" if held_out_file else "train"), "val_path"
    named = _field(row, p.split_column)
    if isinstance(named, str) and named.strip():
        return ("held_out" if named.strip().lower() in HELD_OUT_NAMES else "train"), "split_column"
    return SPLITS[is_held_out(messages)], "hash"


def check_prompt_lengths(manifest: dict, encode: Callable[[list[dict]], list[int]], context: int | None,
                         max_new_tokens: int, path: str) -> None:
    """The longest prompts (by bytes) encoded: one that leaves no room for a completion in the
    model's context stops the run at start, naming its row (rows are counted from 1)."""
    if not context:
        return
    for longest in manifest["longest"]:
        tokens = len(encode(longest["messages"]))
        if tokens + max_new_tokens > context:
            raise ConfigError(f"task.params.path {path}: row {longest['row']}'s prompt is {tokens} tokens, with "
                              f"sampling.max_new_tokens {max_new_tokens} more than the model's context of {context}")


def manifest_of(data: bytes) -> dict:
    """A published manifest, checked: it comes from the broker. {"rows": training rows,
    "shard_rows": rows a shard, "shards": each shard's SHA-256 in hex, "sizes": each one's bytes}:
    a sampler fetches a shard expecting the size its manifest (of the digest the run's config
    names) gives, never one a relay's object info claims."""
    manifest = orjson.loads(data)
    rows, shard_rows, shards, sizes = (manifest.get(k) for k in ("rows", "shard_rows", "shards", "sizes"))
    if not (isinstance(rows, int) and isinstance(shard_rows, int) and rows > 0 and shard_rows > 0
            and isinstance(shards, list) and len(shards) == -(-rows // shard_rows)
            and all(isinstance(s, str) and re.fullmatch(r"[0-9a-f]{64}", s) for s in shards)
            and isinstance(sizes, list) and len(sizes) == len(shards)
            and all(type(n) is int and 0 < n <= PROMPT_SHARD_MAX_BYTES for n in sizes)):
        raise ValueError("not a prompts manifest")
    return manifest


def prompt_of(line: bytes, index: int, answer: str = "") -> Prompt:
    row = orjson.loads(line)
    return Prompt(index, row["messages"], answer, row["data_source"])


# --- rewards ------------------------------------------------------------------------------------

Reward = Callable[[str, str, str], Score]  # (completion, truth, data source)


def reward_by_name(name: str, format_reward: float) -> Reward:
    """The verifier `task.params.reward` names; an unknown one is a one-line error at start."""
    if name == "math":

        return lambda completion, truth, _source: math_score(completion, final_answer(truth), format_reward)
    if name == "exact":
        return lambda completion, truth, _source: _compare(_last_boxed(completion), truth, format_reward)
    if name.startswith("regex:"):
        try:
            pattern = re.compile(name.removeprefix("regex:"))
        except re.error as e:
            raise ConfigError(f"task.params.reward {name!r}: not a regular expression ({e})") from None
        if pattern.groups != 1:
            raise ConfigError(f"task.params.reward {name!r}: the pattern needs one group, the answer")
        return lambda completion, truth, _source: _compare(
            (pattern.findall(completion) or [None])[-1], truth, format_reward)
    if name == "reasoning_gym":
        return _gym_reward(format_reward)
    module, _, function = name.rpartition(":")
    if not module:
        raise ConfigError(f"task.params.reward {name!r}: not math, exact, regex:<pattern>, reasoning_gym or "
                          "module:function")
    try:
        user = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task.params.reward {name!r}: {e}") from None
    return lambda completion, truth, source: _user_score(float(user(completion, truth, source)))


def _last_boxed(completion: str) -> str | None:

    last = completion.rfind("\\boxed{")
    return boxed(completion[last : last + MAX_ANSWER_CHARS]) if last >= 0 else completion.strip() or None


def _compare(answer: str | None, truth: str, format_reward: float) -> Score:
    if answer is None:
        return Score(0.0, format_ok=False, correct=False)
    correct = answer.strip() == truth.strip()
    return Score(1.0 if correct else format_reward, format_ok=True, correct=correct)


def _user_score(reward: float) -> Score:
    return Score(reward, format_ok=True, correct=reward >= 1.0)


def _gym_reward(format_reward: float) -> Reward:
    try:
        from reasoning_gym import get_score_answer_fn
        from reasoning_gym.utils import extract_answer
    except ModuleNotFoundError:
        raise ConfigError("task.params.reward 'reasoning_gym' needs reasoning-gym: pip install 'echo-rl[tasks]'") \
            from None
    verifiers = lru_cache(maxsize=None)(get_score_answer_fn)

    def score(completion: str, truth: str, source: str) -> Score:
        answer = extract_answer(completion)
        if answer is None:
            return Score(0.0, format_ok=False, correct=False)
        try:
            verdict = float(verifiers(source)(answer, {"answer": truth, "metadata": {}}))
        except Exception:  # noqa: BLE001 - an unknown source, or a verifier that cannot read the answer
            verdict = 0.0
        return Score(1.0, True, True) if verdict >= 1.0 else Score(max(verdict, format_reward), True, False)

    return score


# --- the task -----------------------------------------------------------------------------------

class Dataset:
    """The training prompts by index (index modulo the training rows), the held-out rows for
    evaluation, and the reward by name. On the trainer, from `path`; on a sampler (no path,
    `prompts` set), it holds no rows: its prompts come through the broker (streams/prompts.py)."""

    name = "dataset"
    environment = False
    answers_on_samplers = False  # a sampler never scores a group of this task; the trainer does

    def __init__(self, params: dict):
        self.p = parse_params(DatasetParams, params)
        self.reward = reward_by_name(self.p.reward, self.p.format_reward)
        if self.p.path is None and self.p.prompts is None:
            raise ConfigError("task.params.path: the dataset's file or folder, on the trainer")
        self.folder = built_dataset(self.p) if self.p.path else None
        self.manifest = orjson.loads((self.folder / "manifest.json").read_bytes()) if self.folder else None
        self._lines = lru_cache(maxsize=SHARDS_KEPT)(self._read_shard)

    @property
    def remote_prompts(self) -> str | None:
        """The published manifest's digest, where this process holds no rows (a sampler)."""
        return self.p.prompts if self.manifest is None else None

    def _read_shard(self, split: str, shard: int, kind: str) -> list[bytes]:
        return (self.folder / f"{split}-{shard:06d}.{kind}").read_bytes().splitlines()

    def _row(self, split: str, index: int) -> Prompt:
        if self.manifest is None:
            raise RuntimeError("a sampler's dataset task has no rows: its prompts come from the broker")
        at = index % self.manifest["rows"][split]
        shard, line = divmod(at, SHARD_ROWS)
        return prompt_of(self._lines(split, shard, "prompts")[line], index,
                         orjson.loads(self._lines(split, shard, "answers")[line]))

    def prompt(self, index: int) -> Prompt:
        return self._row("train", index)

    def held_out(self, n: int) -> list[Prompt]:
        return [self._row("held_out", i) for i in range(min(n, self.manifest["rows"]["held_out"]))]

    @property
    def held_out_source(self) -> str:
        """What the held-out rows are, said where an evaluation gets fewer prompts than it asked."""
        by = self.manifest.get("held_out_by", {})
        said = []
        if "val_path" in by:
            said.append(f"{by['val_path']} rows of task.params.val_path")
        if "split_column" in by:
            said.append(f"{by['split_column']} rows whose {self.p.split_column} is one of {', '.join(HELD_OUT_NAMES)}")
        if "hash" in by:
            said.append(f"{by['hash']} rows held out by a hash of the prompt (a tenth of those with no "
                        f"{self.p.split_column}; task.params.val_path names a validation file)")
        return "; ".join(said) or (f"no held-out rows in {self.p.path}: name a validation file "
                                   "(task.params.val_path), or mark rows test in a split column "
                                   "(task.params.split_column)")

    def score(self, completion: str, prompt: Prompt) -> Score:
        return self.reward(completion, prompt.answer, prompt.source)

    @property
    def answer_marker(self) -> str | None:
        """What a prompt asking for the answer's form names (None: a rule it cannot tell)."""
        return {"math": "\\boxed", "exact": "\\boxed", "reasoning_gym": "<answer>"}.get(self.p.reward)

    @property
    def answer_format(self) -> str:
        reward = self.p.reward
        if reward in ("math", "exact"):
            return "\\boxed{} answer"
        if reward.startswith("regex:"):
            return f"match of {reward}"
        return "<answer></answer> block" if reward == "reasoning_gym" else f"answer {reward} can read"

    def published_prompts(self) -> tuple[bytes, list[Path]]:
        """What the trainer publishes: the manifest (manifest_of) and the training prompts' shard files."""
        digests = self.manifest["shards"]["train"]
        files = [self.folder / f"train-{i:06d}.prompts" for i in range(len(digests))]
        manifest = {"rows": self.manifest["rows"]["train"], "shard_rows": SHARD_ROWS, "shards": digests,
                    "sizes": [f.stat().st_size for f in files]}
        return orjson.dumps(manifest), files
