"""A user's dataset named once, on the trainer (echo/tasks/dataset.py, streams/prompts.py): the
formats of verl and TRL and a saved `datasets` folder, columns mapped by config, rewards by
name, one line for each bad input, and the prompts (never the answers) through the broker."""

from __future__ import annotations

import asyncio
import sys

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo.config import ConfigError, TaskConfig
from echo.config.edge import drop_this_box_fields
from echo.tasks import is_held_out, load_task
from echo.tasks.dataset import SHARD_ROWS
from streams.prompts import PromptShards, publish_prompts
from tests.conftest import verl_rows


def dataset(tmp_path, monkeypatch, **params):
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    return load_task(TaskConfig(name="dataset", params=params))


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_verl_parquet_file_gives_prompts_answers_and_a_stable_held_out_split(tmp_path, monkeypatch):
    rows = verl_rows(3 * SHARD_ROWS + 10)
    rows[5]["reward_model"]["ground_truth"] = None  # a row without an answer: skipped and counted
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "train.parquet", rows))
    train, held_out = task.manifest["rows"]["train"], task.manifest["rows"]["held_out"]
    assert train + held_out == len(rows) - 1 and task.manifest["skipped"] == {"no_answer": 1}
    assert 0.05 < held_out / len(rows) < 0.15  # a tenth, by a hash of the prompt
    assert task.manifest["columns"] == {"prompt": "prompt", "answer": "reward_model.ground_truth"}
    seen = set()
    for i in range(train):
        prompt = task.prompt(i)
        question = prompt.messages[-1]["content"]
        number = int(question.split()[2])
        assert prompt.answer == str(2 * number) and prompt.source == "openai/gsm8k" and not is_held_out(prompt.messages)
        seen.add(question)
    assert task.prompt(train + 3) == task.prompt(3).__class__(train + 3, *list(vars(task.prompt(3)).values())[1:])
    assert all(is_held_out(p.messages) and p.messages[-1]["content"] not in seen for p in task.held_out(held_out + 5))
    again = dataset(tmp_path, monkeypatch, path=str(tmp_path / "train.parquet"))  # built once, read again
    assert again.folder == task.folder and [again.prompt(i) for i in range(50)] == [task.prompt(i) for i in range(50)]


def test_trl_messages_json_lines_and_a_saved_datasets_folder_read_alike(tmp_path, monkeypatch):
    import datasets

    trl = [{"messages": [{"role": "user", "content": f"Capital of country {i}?"},
                         {"role": "assistant", "content": f"city {i}"}], "solution": f"city {i}"} for i in range(300)]
    (tmp_path / "trl.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in trl))
    from_jsonl = dataset(tmp_path, monkeypatch, path=str(tmp_path / "trl.jsonl"), reward="exact")
    first = from_jsonl.prompt(0)
    assert first.messages == [{"role": "user", "content": first.messages[0]["content"]}]  # the answer's turn dropped
    assert first.answer == "city " + first.messages[0]["content"].split()[-1].rstrip("?")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl)}).save_to_disk(str(tmp_path / "saved"))
    from_folder = dataset(tmp_path, monkeypatch, path=str(tmp_path / "saved"), reward="exact")
    (tmp_path / "trl.json").write_bytes(orjson.dumps(trl))
    from_array = dataset(tmp_path, monkeypatch, path=str(tmp_path / "trl.json"), reward="exact")
    assert [from_folder.prompt(i) for i in range(40)] == [from_array.prompt(i) for i in range(40)] == [
        from_jsonl.prompt(i) for i in range(40)]


def test_columns_are_mapped_by_config_and_a_text_prompt_takes_the_instruction(tmp_path, monkeypatch):
    rows = [{"q": f"{i} times 3", "meta": {"truth": str(3 * i)}} for i in range(100)]
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "own.parquet", rows), prompt="q",
                   answer="meta.truth", instruction="Compute {prompt}. Answer in \\boxed{{}}.")
    prompt = task.prompt(0)
    number = int(prompt.messages[0]["content"].split()[1])
    assert prompt.messages[0]["content"] == f"Compute {number} times 3. Answer in \\boxed{{}}."
    assert prompt.answer == str(3 * number) and task.score(f"\\boxed{{{3 * number}}}", prompt).correct


def test_a_chat_prompts_last_user_turn_takes_the_instruction_too(tmp_path, monkeypatch):
    """An instruction for chat prompts: task.params.instruction was applied to text prompts only, and a verl parquet's
    chat prompts were left as they were without a word, while run.no_signal named that key as the
    remedy. The last user turn now goes through it (a system turn and an earlier exchange kept)."""
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}, "data_source": "mine"} for i in range(50)]
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "chat.parquet", rows),
                   instruction="{prompt} Put your final answer in \\boxed{{}}.")
    messages = task.prompt(0).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[:3] == rows[0]["prompt"][:3]
    assert messages[3]["content"].startswith("What is ") and messages[3]["content"].endswith(
        "? Put your final answer in \\boxed{}.")


def test_worked_examples_go_before_every_prompt_and_the_instruction_is_written_as_a_person_writes_it(
        tmp_path, monkeypatch):
    """The remedy for a model that does not box its answer zero-shot, as the built-in
    math task does it: a solved example as an earlier exchange, after any system prompt. The
    instruction's braces as written (`\\boxed{}` raised IndexError from str.format), and an
    instruction without {prompt}, which would drop every row's question, refused at start."""
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(50)]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    task = dataset(tmp_path, monkeypatch, path=path, instruction="{prompt} Put your final answer in \\boxed{}.",
                   examples=[["What is 3 + 4?", "3 + 4 = 7, so \\boxed{7}"]])
    messages = task.prompt(0).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"] == "What is 3 + 4? Put your final answer in \\boxed{}."
    assert messages[2]["content"] == "3 + 4 = 7, so \\boxed{7}" and messages[3]["content"].endswith("\\boxed{}.")
    with pytest.raises(ConfigError, match=r"task.params.instruction"):
        dataset(tmp_path, monkeypatch, path=path, instruction="Put your final answer in \\boxed{}.")


def test_rewards_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def half(completion, truth, source):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_parquet(tmp_path / "r.parquet", verl_rows(50))

    def score(reward, completion, **row):
        task = dataset(tmp_path, monkeypatch, path=path, reward=reward)
        from echo.tasks import Prompt

        return task.score(completion, Prompt(0, [], row.get("truth", "12"), row.get("source", "")))

    assert score("math", "so \\boxed{12}").correct and score("math", "\\boxed{\\frac{24}{2}}").correct
    assert score("math", "#### 12", truth="blah #### 12").reward == 0.0  # no \boxed{}: no answer
    assert score("exact", "\\boxed{12}").correct and not score("exact", "\\boxed{12.0}").correct
    assert score("exact", " 12 ").correct  # no \boxed{}: the whole text
    assert score("regex:ANSWER: (\\d+)", "ANSWER: 3 ... ANSWER: 12").correct
    assert score("regex:ANSWER: (\\d+)", "nothing").reward == 0.0
    assert score("my_reward:half", "anything").reward == 0.5
    gym = score("reasoning_gym", "<answer>12</answer>", source="chain_sum")
    assert gym.correct and not score("reasoning_gym", "<answer>13</answer>", source="chain_sum").correct


@pytest.mark.parametrize("params, said", [
    ({"reward": "nope"}, "task.params.reward 'nope': not math, exact, regex:<pattern>, reasoning_gym or module:function"),
    ({"reward": "regex:\\d+"}, "the pattern needs one group"),
    ({"reward": "regex:(\\d+"}, "not a regular expression"),
    ({"reward": "no_such_module:f"}, "task.params.reward 'no_such_module:f': No module named 'no_such_module'"),
    ({"prompt": "question"}, "task.params.prompt: .* has no column 'question'; its columns: ability, data_source, extra_info, prompt, reward_model"),
    ({"answer": "label"}, "task.params.answer: .* has no column 'label'"),
    ({"path": None}, "task.params.path: the dataset's file or folder, on the trainer"),
])
def test_a_bad_dataset_setting_is_one_line_naming_its_field(tmp_path, monkeypatch, params, said):
    params = {"path": write_parquet(tmp_path / "d.parquet", verl_rows(20)), **params}
    with pytest.raises(ConfigError, match=said) as refused:
        dataset(tmp_path, monkeypatch, **params)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name, content, said", [
    ("empty.jsonl", b"", "no training rows"),
    ("no-answers.jsonl", b'{"prompt": "a", "answer": ""}\n{"prompt": "b", "answer": null}\n',
     "no training rows \\(2 rows skipped: {'no_answer': 2}\\)"),
    ("text.parquet", b"prompt,answer\n1,2\n", "task.params.path .*text.parquet: not a .parquet file it can read"),
    ("broken.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n', "broken.jsonl, line 2: not JSON"),
    ("rows.csv", b"prompt,answer\n", "not .jsonl, .json, .parquet, .arrow or a saved dataset's folder"),
])
def test_a_bad_dataset_file_is_one_line_naming_it(tmp_path, monkeypatch, name, content, said):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=said) as refused:
        dataset(tmp_path, monkeypatch, path=str(tmp_path / name))
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="no such file or folder"):
        dataset(tmp_path, monkeypatch, path=str(tmp_path / "missing.parquet"))


def test_a_sampler_reads_the_prompts_through_the_broker_and_never_an_answer(tmp_path, monkeypatch, runs):
    """The trainer publishes the prompt shards and their manifest; a sampler given the run's
    config (its path dropped, as an edge sampler drops it) reads the same prompts by index, each
    shard checked against its digest; nothing it can read holds an answer."""
    answer = lambda i: f"{7_000_000_000 + 13 * i}"  # noqa: E731 - no prompt holds such a number
    trainer_task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "t.parquet", verl_rows(2500, answer)))

    async def main():
        run = await runs.open("prompts")
        digest = await publish_prompts(run, *trainer_task.published_prompts())
        assert await publish_prompts(run, *trainer_task.published_prompts()) == digest  # a restart: already there
        broker = {"task": {"name": "dataset", "params": {"path": trainer_task.p.path, "prompts": digest}}}
        drop_this_box_fields(broker)
        sampler_task = load_task(TaskConfig(**broker["task"]))
        assert sampler_task.remote_prompts == digest and sampler_task.manifest is None
        shards = PromptShards(run, digest)
        for i in [0, 1, 2023, 5000, 123_456_789]:
            got, expected = await shards.prompt(i), trainer_task.prompt(i)
            assert (got.index, got.messages, got.source, got.answer) == (i, expected.messages, expected.source, "")
        info = await run.js.stream_info(f"OBJ_{run.names.weights_bucket}")
        stored = [await run.js.get_msg(f"OBJ_{run.names.weights_bucket}", seq)
                  for seq in range(info.state.first_seq, info.state.last_seq + 1)]
        everything = b"".join(m.data for m in stored)
        assert all(orjson.dumps(trainer_task.prompt(i).messages[-1]["content"]) in everything for i in range(0, 2500, 97))
        assert b"7000000" not in everything

    asyncio.run(main())


def test_a_prompt_longer_than_the_models_context_is_one_line_naming_its_row(tmp_path, monkeypatch):
    from functools import partial

    from echo.model.loading import encode_chat, load_tokenizer
    from echo.tasks.dataset import check_prompt_lengths

    rows = verl_rows(40)
    rows[6]["prompt"][0]["content"] = "long " * 300  # the byte-level tiny tokenizer: ~1,500 tokens
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "long.parquet", rows))
    encode = partial(encode_chat, load_tokenizer("tiny"))
    check_prompt_lengths(task.manifest, encode, 4096, 8, task.p.path)  # room left
    with pytest.raises(ConfigError, match=r"long.parquet: row 7's prompt is \d+ tokens, with sampling.max_new_tokens 8 "
                                          r"more than the model's context of 1024"):
        check_prompt_lengths(task.manifest, encode, 1024, 8, task.p.path)


def test_a_published_manifest_that_lies_is_refused():
    from echo.tasks.dataset import manifest_of

    good = {"rows": 3000, "shard_rows": 1024, "shards": ["a" * 64] * 3, "sizes": [900_000] * 3}
    assert manifest_of(orjson.dumps(good)) == good
    for bad in ({**good, "rows": 5000}, {**good, "shards": ["x" * 64] * 3}, {**good, "shard_rows": 0},
                {**good, "sizes": [900_000] * 2}, {**good, "sizes": [4 << 30] * 3}):  # 4 GiB a shard: a relay's claim
        with pytest.raises(ValueError):
            manifest_of(orjson.dumps(bad))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_a_validation_file_or_a_split_column_names_the_held_out_rows(tmp_path, monkeypatch):
    """verl's data.val_files and extra_info.split, TRL's eval_dataset: the held-out rows are the
    ones the user named, every other row trains; a hash-chosen tenth only where nothing says."""
    train, val = verl_rows(300), verl_rows(40, answer=lambda i: str(i + 1))
    for row in val:
        row["prompt"][0]["content"] = row["prompt"][0]["content"].replace("What is", "Compute")
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "train.parquet", train),
                   val_path=write_parquet(tmp_path / "test.parquet", val))
    assert task.manifest["rows"] == {"train": 300, "held_out": 40}
    assert [p.messages for p in task.held_out(100)] == [r["prompt"] for r in val]
    assert task.held_out_source == "40 rows of task.params.val_path"

    marked = verl_rows(100)
    for i, row in enumerate(marked):
        row["extra_info"]["split"] = "test" if i % 4 == 0 else "train"
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "marked.parquet", marked))
    assert task.manifest["rows"] == {"train": 75, "held_out": 25}
    assert [p.messages for p in task.held_out(100)] == [r["prompt"] for r in marked[::4]]
    assert task.held_out_source.startswith("25 rows whose extra_info.split is one of test, val")

    only_train = [dict(row, extra_info={"split": "train"}) for row in verl_rows(50)]
    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "only.parquet", only_train))
    assert task.manifest["rows"] == {"train": 50, "held_out": 0}
    assert "name a validation file (task.params.val_path)" in task.held_out_source

    task = dataset(tmp_path, monkeypatch, path=write_parquet(tmp_path / "plain.parquet", verl_rows(200)))
    held = task.manifest["rows"]["held_out"]
    assert task.held_out_source.startswith(f"{held} rows held out by a hash of the prompt")
