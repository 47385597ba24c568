"""Exactly-once training across a trainer crash: checkpoint, resume, and a real kill -9."""

import asyncio
import os
import signal
from pathlib import Path

import orjson
import pytest
import torch

from echo.config import LoraConfig
from echo.model.loading import load_model
from echo.model.policy import make_policy
from echo.train.checkpoint import (
    TrainerState,
    append_trained_completions,
    append_trained_content,
    load_checkpoint,
    load_trained_completions,
    load_trained_content,
    save_checkpoint,
)
from echo.train.learner import learning_rate
from echo.wire.names import HDR_MSG_ID, RunNames
from streams.client import connect
from streams.replay import read_rollouts
from streams.rollouts import is_reader
from tests.conftest import (
    alive,
    assert_balanced,
    eventually,
    read_metrics,
    tiny_config,
    wait_for_steps,
    worker_process,
)
from workers.operator.swarm import stop_processes
from workers.trainer.accounting import restore_metrics


def _policy_and_optimizer(lora: LoraConfig):
    model, _ = load_model("tiny")
    policy = make_policy(model, lora)
    return policy, torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("lora", [LoraConfig(r=4), LoraConfig(enabled=False)], ids=["lora", "full"])
def test_checkpoint_restores_weights_optimizer_rng_and_state(tmp_path, lora):
    policy, optimizer = _policy_and_optimizer(lora)
    policy(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    state = TrainerState(step=3, version=3, consumed={"floor": 7, "above": [9]}, totals={"trained": 12},
                         trained_content=12, lost=2, record={"step": 3, "staleness_used": {0: 4}})
    save_checkpoint(tmp_path / "ckpt.pt", policy, optimizer, state)
    expected_draw = torch.rand(3)

    other, other_optimizer = _policy_and_optimizer(lora)
    torch.rand(5)  # move the RNG on; the checkpoint must put it back
    restored = load_checkpoint(tmp_path / "ckpt.pt", other, other_optimizer)
    assert restored == state
    assert torch.equal(torch.rand(3), expected_draw)
    for (name, a), (_, b) in zip(policy.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    assert other_optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])
    assert load_checkpoint(tmp_path / "missing.pt", other, other_optimizer) is None


def test_restore_metrics_keeps_one_line_per_checkpointed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1}, {"step": 2}, {"step": 3}]  # step 3 was written, its checkpoint was not
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    restore_metrics(tmp_path, TrainerState(step=2, record={"step": 2, "step_seconds": 3.0, "wait_seconds": 1.0}))
    assert [orjson.loads(x)["step"] for x in path.read_bytes().splitlines()] == [1, 2]
    # The checkpoint of step 3 landed, its metrics line did not.
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines[:2]))
    restore_metrics(tmp_path, TrainerState(step=3, record={"step": 3, "step_seconds": 3.0, "wait_seconds": 1.0}))
    assert [orjson.loads(x) for x in path.read_bytes().splitlines()][-1] == {
        "step": 3, "step_seconds": 3.0, "wait_seconds": 1.0, "busy_seconds": 2.0, "utilisation": 2 / 3, "restored": True}
    # Killed while appending step 4's line, whose checkpoint never landed: the cut line goes.
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines) + b'{"step": 4, "rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    restore_metrics(tmp_path, TrainerState(step=3, record={"step": 3}))
    assert path.read_bytes().endswith(b"\n") and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_trained_content_keeps_the_checkpoints_hashes_and_cuts_what_a_crash_left_after_them(tmp_path):
    append_trained_content(tmp_path, ["a", "b"])
    append_trained_content(tmp_path, ["c"])  # appended, then the crash: the checkpoint still counts 2
    assert load_trained_content(tmp_path, 2) == {"a", "b"}
    assert (tmp_path / "trained_content.txt").read_text() == "a\nb\n"
    assert load_trained_content(tmp_path / "fresh", 0) == set()
    with pytest.raises(RuntimeError, match="holds 2 content hashes, the checkpoint counts 3"):
        load_trained_content(tmp_path, 3)


def test_trained_completions_keep_the_checkpoints_keys_and_cut_what_a_crash_left_after_them(tmp_path):
    append_trained_completions(tmp_path, [1, 2**64 - 1])
    append_trained_completions(tmp_path, [7])  # appended, then the crash: the checkpoint still counts 2
    with open(tmp_path / "trained_completions.bin", "ab") as f:
        f.write(b"\x01\x02\x03")  # and a key cut short
    assert load_trained_completions(tmp_path, 2) == {1, 2**64 - 1}
    assert (tmp_path / "trained_completions.bin").stat().st_size == 16
    assert load_trained_completions(tmp_path / "fresh", 0) == set()
    with pytest.raises(RuntimeError, match="holds 2 completion keys, the checkpoint counts 3"):
        load_trained_completions(tmp_path, 3)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The process torchrun started as `rank` (its child with RANK=<rank> in its environment)."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    for pid in map(int, children):
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
    raise LookupError(f"no rank {rank} among {children}")


@pytest.mark.slow
@pytest.mark.parametrize("ranks,killed", [(1, "trainer"), (2, "rank 1"), (2, "torchrun")],
                         ids=["one-process", "rank-1-of-2", "launcher-of-2"])
def test_kill_9_the_trainer_and_resume_trains_every_group_once(nats_server, tmp_path, ranks, killed):
    """kill -9 of the trainer, of one of its 2 ranks (torchrun then stops the other), or of
    torchrun itself, in the middle of a step; a new trainer resumes from the checkpoint with
    every group trained once. Killing torchrun left its ranks training unsupervised (step 15
    to 42 in 20 s), and a trainer started meanwhile crashed reading a checkpoint folder they
    pruned: ranks now die with their launcher, and a trainer reads the checkpoint only once it
    holds the run's lease."""
    cfg = tiny_config(tmp_path, run={"id": "crash", "steps": 8}, nats={"url": nats_server.url},
                      trainer={"ack_wait_s": 3.0, "max_staleness": 1, "lr_schedule": "cosine", "warmup_steps": 2})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    samplers = [worker_process(config_path, "sampler", "--id", f"s{i}") for i in (1, 2)]
    trainer = worker_process(config_path, "trainer", ranks=ranks)
    try:
        wait_for_steps(cfg.run_dir, 3, [trainer])
        # In the middle of step 4: groups fetched, not acked.
        rank_pids = [rank_pid(trainer.pid, rank) for rank in range(ranks)] if ranks > 1 else [trainer.pid]
        os.kill(rank_pids[1] if killed == "rank 1" else trainer.pid, signal.SIGKILL)
        trainer.communicate(timeout=60)
        assert trainer.returncode != 0
        eventually(lambda: not any(map(alive, rank_pids)), 30)  # no rank outlives its launcher

        resumed = worker_process(config_path, "trainer", ranks=ranks)
        logs = resumed.communicate(timeout=180)[1]
        assert resumed.returncode == 0, logs[-3000:]
        ready = next(orjson.loads(line) for line in logs.splitlines() if '"trainer.ready"' in line)
        # Resumed from the checkpoint, not from scratch (a kill after a checkpoint and before its
        # metrics line resumes one step later: restore_metrics puts the line back).
        resumed_at = ready["step"]
        assert resumed_at == ready["version"] >= 3
    finally:
        stop_processes(samplers, timeout=30)

    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    # The schedule went on across the crash at the rate of an uninterrupted run (test_learner
    # checks these against transformers' own schedules).
    assert [m["lr"] for m in metrics] == [learning_rate(cfg, step) for step in range(1, 9)]
    assert_balanced(metrics)  # counted once across the crash: nothing twice, nothing lost
    before = [g[0] for m in metrics[:resumed_at] for g in m["groups"]]
    after = [g[0] for m in metrics[resumed_at:] for g in m["groups"]]
    assert before and after and len(set(before + after)) == len(before) + len(after)  # nobody twice

    async def consumed():
        nc = await connect(nats_server.url, "check")
        readers = await nc.jetstream().consumers_info(RunNames("crash").rollouts_stream)
        floors = {info.config.filter_subject: info.ack_floor.stream_seq for info in readers if is_reader(info.name)}
        await nc.close()
        stream = [r async for r in read_rollouts(nats_server.url, "crash")]
        return [r["headers"][HDR_MSG_ID] for r in stream if r["seq"] <= floors[r["subject"]]]

    acked = asyncio.run(consumed())
    dropped = [gid for m in metrics for gid in m["dropped_groups"]]
    # Every group the trainer consumed was trained exactly once or dropped as stale: none lost.
    assert set(acked) <= set(before + after) | set(dropped)
    assert set(before + after) <= set(acked) | {g for m in metrics[-1:] for g, _, _ in m["groups"]}
