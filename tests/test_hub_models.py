"""Models named by Hugging Face id, offline: the tests build a local hub cache (a tiny model
saved in the cache's layout: blobs, snapshots of symlinks, refs) so the loading code is the real
huggingface_hub one, and nothing is downloaded."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from huggingface_hub import constants

from echo.config import ConfigError
from echo.config.edge import check_config_from_broker
from echo.model.loading import base_model_digest, hub_snapshot, load_model, pin_model
from echo.trust.routing import routing_shape
from streams.client import open_run
from streams.registry import read_statuses
from tests.conftest import eventually_async, tiny_config, verl_rows
from workers.trainer.model import Ranks, TrainerModel

REPO = "echo-test/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ECHO_RL = [sys.executable, "-m", "workers.cli"]


def hub_cache(root: Path, repo: str = REPO, commit: str = COMMIT, nudge: float = 0.0, model: str = "tiny") -> Path:
    """A hub cache at `root` holding the tiny model (or `model`) as `repo` at `commit` (branch
    main, tag v1), laid out as huggingface_hub writes it; `nudge` moves every weight, for a copy
    that differs."""
    model, tokenizer = load_model(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(nudge)
    saved = root / "saved"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in saved.iterdir():
        blob = folder / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir()
    for ref in ("main", "v1"):
        (folder / "refs" / ref).write_text(commit)
    saved.rmdir()
    return root


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """This process's huggingface_hub pointed at a fresh cache, offline."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_snapshot.cache_clear()
    yield
    hub_snapshot.cache_clear()


def test_a_model_named_by_hub_id_loads_from_the_cache_pinned_to_its_commit(offline_hub):
    pinned = f"{REPO}@{COMMIT}"
    assert pin_model(REPO) == pin_model(f"{REPO}@main") == pin_model(f"{REPO}@v1") == pin_model(pinned) == pinned
    model, tokenizer = load_model(pinned)
    assert model.num_parameters() == load_model("tiny")[0].num_parameters() and tokenizer.padding_side == "left"
    # By content: the same weights under a hub id are the same base as the built-in tiny model.
    assert base_model_digest(pinned) == base_model_digest("tiny")


def test_a_mixture_of_experts_named_by_hub_id_loads_as_a_dense_model_does(tmp_path, monkeypatch):
    """Its stacked experts and routers saved in the hub's layout come back whole: the same base as
    the built-in tiny MoE, routing alike."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "echo-test/tiny-moe", model="tiny-moe")))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_snapshot.cache_clear()
    try:
        model, _ = load_model("echo-test/tiny-moe")
        assert routing_shape(model) == (2, 2, 8)
        assert base_model_digest("echo-test/tiny-moe") == base_model_digest("tiny-moe")
    finally:
        hub_snapshot.cache_clear()


@pytest.mark.parametrize("name, said", [
    (f"{REPO}@no-such-branch", f"revision no-such-branch of {REPO} is not in the hub cache"),
    ("echo-test/not-cached", "revision main of echo-test/not-cached is not in the hub cache"),
])
def test_a_hub_model_that_cannot_be_had_is_one_line_naming_it(offline_hub, name, said):
    with pytest.raises(ConfigError, match=said) as refused:
        pin_model(name)
    assert "HF_HUB_OFFLINE is set" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("command", [["trainer", "--nats", "nats://127.0.0.1:1"], ["up"]])
def test_the_trainer_or_a_swarm_given_a_hub_id_it_cannot_have_stops_at_start_in_one_line(tmp_path, command):
    """`up` pins the model in a child of its own (workers/operator/swarm.py::in_child): its error too."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*ECHO_RL, *command, "--model", f"{REPO}@v2", "--run-id", "r", "--set",
                           f'run.dir="{tmp_path}"'], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"model.name '{REPO}@v2': revision v2 of {REPO} is not in the hub cache" in done.stderr


def test_a_run_resumed_on_another_base_is_refused_naming_both(tmp_path, monkeypatch):
    """A branch that moved between a trainer's starts (or a folder edited): the checkpoint's
    adapter was trained on another base, and is not resumed on this one."""
    first = TrainerModel(tiny_config(tmp_path), Ranks("cpu"))
    first.resume()
    first.save(first.state)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", nudge=1e-3)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_snapshot.cache_clear()
    moved = TrainerModel(tiny_config(tmp_path, model={"name": pin_model(f"{REPO}@main")}), Ranks("cpu"))
    hub_snapshot.cache_clear()
    with pytest.raises(ConfigError, match=f"is base {moved.base_model}.*trained on base {first.base_model}"):
        moved.resume()


def test_an_edge_sampler_takes_from_the_broker_a_hub_model_at_a_commit_only():
    check_config_from_broker({"model": {"name": f"{REPO}@{COMMIT}"}}, {})  # data: the weights' digest checks it
    for moving in (REPO, f"{REPO}@main"):  # which files a branch names is the hub's to change
        with pytest.raises(ConfigError, match="model.name"):
            check_config_from_broker({"model": {"name": moving}}, {})


@pytest.mark.slow
def test_a_run_on_a_hub_model_and_a_verl_dataset_trains_samplers_given_only_the_run_and_refuses_a_differing_copy(
        tmp_path, nats_server):
    """The trainer is given the hub id and a verl-format parquet file; two samplers are given the
    server and the run id only: they load the revision the trainer pinned from their own cache and
    read their prompts from the broker (no file, no answer). A third's cache holds other bytes
    under the same commit: it refuses every version, naming both bases, and generates nothing."""
    same, other = hub_cache(tmp_path / "hub"), hub_cache(tmp_path / "other-hub", nudge=1e-3)
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(300)), data)
    processes = []

    def start(cache: Path, *args: str) -> subprocess.Popen:
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "ECHO_CACHE": str(tmp_path / "echo")}
        processes.append(subprocess.Popen([*ECHO_RL, *args, "--log-json"], cwd=tmp_path, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        return processes[-1]

    try:
        trainer = start(same, "trainer", "--model", f"{REPO}@main", "--steps", "2", "--run-id", "hub",
                        "--nats", nats_server.url, "--set", f'run.dir="{tmp_path / "runs"}"', "--set", "lora.r=4",
                        "--set", "sampling.group_size=4", "--set", "sampling.max_new_tokens=8",
                        "--set", "trainer.groups_per_step=2", "--set", "trainer.threads=1",
                        "--set", "run.eval_prompts=0", "--set", 'task.name="dataset"',
                        "--set", f'task.params.path="{data}"')
        for sampler_id, cache in (("s1", same), ("s2", same), ("odd", other)):
            start(cache, "sampler", "--nats", nats_server.url, "--run-id", "hub", "--id", sampler_id,
                  "--set", "sampler.heartbeat_s=0.5")
        _, trainer_log = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, trainer_log[-3000:]
        ready = next(orjson.loads(line) for line in trainer_log.splitlines() if '"trainer.ready"' in line)
        assert ready["model"] == f"{REPO}@{COMMIT}"  # pinned before the run's config was written
        assert '"prompts.published"' in trainer_log  # the samplers hold no file: they read these
        metrics = [orjson.loads(line) for line in (tmp_path / "runs" / "hub" / "metrics.jsonl").read_bytes().splitlines()]
        assert [m["used"] for m in metrics] == [2, 2] and sum(sum(m["rejected"].values()) for m in metrics) == 0

        async def statuses():
            """Once every sampler has said where it stands: any of them may start after the run
            ends (three samplers load at once here; the odd one then refuses the last version),
            and a heartbeat counts the groups published before it."""
            run = await open_run(nats_server.url, "hub", "check", create=False)
            async def said():
                seen = {s.sampler_id: s for s in await read_statuses(run)}
                return seen if {"s1", "s2", "odd"} <= seen.keys() and seen["odd"].weight_failures and \
                    seen["s1"].groups_published + seen["s2"].groups_published >= 4 else None

            try:
                return await eventually_async(said, 120, every=0.5)
            finally:
                await run.close()

        seen = asyncio.run(statuses())
        assert seen["s1"].weight_failures == seen["s2"].weight_failures == {}
        assert seen["s1"].groups_published + seen["s2"].groups_published >= 4
        assert seen["odd"].groups_published == 0 and seen["odd"].weight_failures.get("wrong_base_model", 0) >= 1
    finally:
        for p in processes:
            if p.poll() is None:
                p.terminate()
    odd_log = processes[-1].communicate(timeout=60)[1]
    refused = next(orjson.loads(line) for line in odd_log.splitlines() if '"weights.wrong_base_model"' in line)
    assert refused["announced"] == base_model_digest("tiny") != refused["ours"]
