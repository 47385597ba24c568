"""Experiment trackers (workers/trainer/trackers.py, echo/train/metrics.py): what each step logs, under
documented names, read back from TensorBoard's event files, W&B's offline run files and MLflow's
store, across a trainer restart; a tracker that fails is dropped and the run goes on."""

from __future__ import annotations

import glob
import struct
import subprocess

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo.train.metrics import sampler_scalars, step_scalars
from echo.wire.messages import SamplerStatus
from tests.conftest import tiny_config, verl_rows
from tests.swarms import up_command
from workers.trainer.trackers import Trackers, mlflow_store

ALL = 'run.trackers=["tensorboard", "wandb", "mlflow"]'


def tensorboard_scalars(run_dir, name: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(name)}


def tensorboard_texts(run_dir, tag: str) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


def wandb_history(run_dir, name: str) -> dict[int, float]:
    """Every offline run's logged `name` by step: W&B writes its records in LevelDB's log
    format (32 KiB blocks, 7-byte record headers) after a 7-byte header of its own."""
    from wandb.proto import wandb_internal_pb2

    found, ids = {}, set()
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, pos, pending = open(path, "rb").read(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # a block's padding
                pos += left
                continue
            pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or a record's last piece
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "run":
                    ids.add(record.run.run_id)
                if record.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                    if name in items:
                        found[int(items["_step"])] = float(items[name])
    return found, ids


def mlflow_history(run_dir, name: str) -> tuple[dict[int, float], int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(run_dir))
    runs = client.search_runs([client.get_experiment_by_name("echo-rl").experiment_id])
    return {m.step: m.value for r in runs for m in client.get_metric_history(r.info.run_id, name)}, len(runs)


def test_a_steps_record_and_heartbeats_become_named_scalars():
    record = {"step": 3, "version": 3, "reward_mean": 0.5, "mismatch_kl": 1e-5, "train_seconds": 2.0,
              "staleness_used": {"0": 3, "2": 1}, "rejected": {"bad_shape": 2}, "proof_of_sampling": {"ok": 4},
              "reward_by_source": {"gsm8k": 0.25}, "phase_seconds": {"publish": 0.1, "account": 0.02, "train": 2.0},
              "quarantined": ["x"]}
    beat = SamplerStatus(sampler_id="s1", version=2, groups_published=9, weight_failures={}, updated_at=0.0,
                         groups_per_s=1.5, tokens_per_s=300.0, sync_s={"1": 0.4, "2": 0.3})
    got = step_scalars(record, strikes=2) | sampler_scalars([beat], record["version"])[0]
    assert got["reward/mean"] == 0.5 and got["mismatch/kl"] == 1e-5 and got["reward/source/gsm8k"] == 0.25
    assert got["staleness/used/2"] == 1 and got["staleness/mean"] == 0.5
    assert got["groups/rejected/bad_shape"] == 2 == got["groups/rejected_total"] and got["proof/ok"] == 4
    assert got["broker/overhead_share"] == pytest.approx(0.06) and got["quarantine/strikes"] == 2
    assert (got["sampler/s1/tokens_per_s"], got["sampler/s1/sync_s"], got["sampler/s1/version_lag"]) == (300, 0.3, 1)


def test_a_tracker_that_fails_is_dropped_once_and_the_others_go_on(tmp_path, capsys):
    cfg = tiny_config(tmp_path, run={"trackers": ["tensorboard", "mlflow"]})
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "tensorboard").write_text("a file where its folder goes")  # it cannot start
    trackers = Trackers(cfg)
    assert [t.name for t in trackers.live] == ["mlflow"]
    mlflow = trackers.live[0]
    mlflow.client.delete_run(mlflow.run_id)  # its run gone from under it: its next log raises
    trackers.log(1, {"reward/mean": 0.5})
    trackers.log(2, {"reward/mean": 0.5})
    assert trackers.live == []
    trackers.finish({"steps": 2})
    trackers.close()
    said = capsys.readouterr().out + capsys.readouterr().err
    assert said.count("tracker.failed") == 2 and "tensorboard" in said and "mlflow" in said


@pytest.mark.slow
def test_every_tracker_reads_back_every_step_across_a_trainer_restart(tmp_path):
    """A user's verl parquet whose completions never box their answer (the tiny model's): two
    steps, the swarm stopped, then the same run taken to four and evaluated: one tracker run
    each; evaluations every 2 steps on its validation file and `up`'s at each end, at their steps;
    the run says why it cannot learn, once, and shows what the model wrote."""
    data, val = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(200)), data)
    pq.write_table(pa.Table.from_pylist(verl_rows(5, answer=lambda i: str(i))), val)
    said = []
    for steps in (2, 4):  # evaluated every 2 steps on the validation file, and by `up` at its end
        done = subprocess.run(up_command(tmp_path, "tracked", steps, ALL, "run.eval_prompts=3", "run.eval_every=2",
                                         'task.name="dataset"', f'task.params.path="{data}"',
                                         f'task.params.val_path="{val}"', "trainer.no_signal_steps=2"),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "tracker.failed" not in done.stderr and "swarm.tensorboard" in done.stderr  # how to look
        said.append(done.stdout + done.stderr)  # the workers log to stdout
    # After two steps with nothing to learn: the warning, naming the cause; not again after the restart.
    # (the cause is logged as its repr: the backslash doubled)
    assert "run.no_signal" in said[0] and "100% of completions have no \\\\boxed{} answer" in said[0], said[0][-3000:]
    assert "run.no_signal" not in said[1]
    run_dir = tmp_path / "tracked"
    steps = [1, 2, 3, 4]
    # A sampler beats as soon as it runs its first weights: its version lag and sync time are
    # there from the first step.
    for name in ("reward/mean", "mismatch/kl", "learner/utilisation", "groups/used", "time/phase/publish",
                 "sampler/s1/tokens_per_s", "sampler/s1/version_lag", "sampler/s2/sync_s"):
        assert sorted(tensorboard_scalars(run_dir, name)) == steps, name
        history, ids = wandb_history(run_dir, name)
        assert sorted(history) == steps and ids == {"tracked"}, name  # the same W&B run, continued
        metrics, runs = mlflow_history(run_dir, name)
        assert sorted(metrics) == steps and runs == 1, name
    assert tensorboard_scalars(run_dir, "groups/used") == {s: 4.0 for s in steps}
    assert tensorboard_scalars(run_dir, "signal/zero_spread_share") == {s: 1.0 for s in steps}
    assert tensorboard_scalars(run_dir, "signal/no_answer_share") == {s: 1.0 for s in steps}
    assert all(0 < n <= 8 for n in tensorboard_scalars(run_dir, "completions/max_length").values())
    samples = [orjson.loads(line) for line in (run_dir / "samples.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in samples] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all("boxed" in r["prompt"] and r["reward"] == 0.0 and r["sampler"] in ("s1", "s2") for r in samples)
    assert sorted(tensorboard_texts(run_dir, "samples")) == steps
    tables = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*.table.json"))
    assert len(tables) == 4 and all(orjson.loads(open(t, "rb").read())["columns"][:2] == ["step", "group"]
                                    for t in tables)  # a W&B table a step
    logged = sorted(glob.glob(str(run_dir / "mlflow-artifacts" / "*" / "artifacts" / "samples" / "step-*.json")))
    assert [orjson.loads(open(p, "rb").read())[0]["step"] for p in logged] == steps  # an MLflow artifact a step
    # Evaluated before step 1 (the base: verl's val_before_train, once: not again on the resume)
    # and during training at steps 2 and 4 (evals.jsonl), beside `up`'s base-and-trained at each end.
    evals = [orjson.loads(line) for line in (run_dir / "evals.jsonl").read_bytes().splitlines()]
    assert [(e["step"], e["version"], e["prompts"]) for e in evals] == [(0, 0, 3), (2, 2, 3), (4, 4, 3)]
    assert sorted(tensorboard_scalars(run_dir, "eval/trained_reward")) == [0, 2, 4]
    assert sorted(tensorboard_scalars(run_dir, "time/phase/evaluate")) == [2, 4]
    assert sorted(wandb_history(run_dir, "eval/prompts")[0].items()) == [(0, 3.0), (2, 3.0), (4, 3.0)]
    assert sorted(mlflow_history(run_dir, "eval/trained_correct")[0]) == [0, 2, 4]
    assert sorted(mlflow_history(run_dir, "eval/base_correct")[0]) == [2, 4]
