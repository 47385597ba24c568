"""docs/operations.md's "Several machines" walkthrough on a trusted network, followed to the letter
on one machine: the hub from `echo-rl hub` (free ports for this test, on the loopback), the
trainer on the shipped docs/run.toml, a site relay with its own client port, a sampler behind it
that knows only the relay's URL and the run id, then status, report, eval and replay; the trainer
given the README's own model, dataset and tracker options (a verl parquet and its validation file,
evaluated during training, TensorBoard), overrides as Hydra takes them. The one departure: the tiny model and 3 steps, not SmolLM2 and 40."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streams.server import free_port
from tests.conftest import verl_rows
from workers.operator.swarm import stop_processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
ECHO_RL = [sys.executable, "-m", "workers.cli"]
SMALL = ["--model", "tiny", "--steps", "3", "--set", "lora.r=4", "--set", "sampling.group_size=4",
         "--set", "sampling.max_new_tokens=8", "--set", "trainer.threads=1"]


def test_the_walkthrough_on_a_trusted_network(tmp_path):
    client, leaf = free_port(), free_port()
    hub_url, relay_port = f"nats://127.0.0.1:{client}", free_port()
    processes = []

    def start(*args: str) -> subprocess.Popen:
        processes.append(subprocess.Popen(list(args), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        return processes[-1]

    try:
        hub = start(*ECHO_RL, "hub", "--host", "127.0.0.1", "--port", str(client), "--leaf-port", str(leaf),
                    "--log-json")  # 1. the hub (--insecure on other interfaces)
        ready = orjson.loads(next(line for line in hub.stderr if '"hub.ready"' in line))
        assert ready["url"] == hub_url and ready["sampler"].startswith(f"echo-rl sampler --nats {hub_url} --run-id")
        assert ready["relay"].startswith(f"echo-rl relay --hub nats-leaf://127.0.0.1:{leaf} ")
        # 2. as the README's "your model, your dataset, your tracker": a verl parquet with its
        # validation file, evaluated during training, a tracker, overrides Hydra's way.
        # Its chat prompts do not ask for the answer's form: the documented prompt options add it
        # (docs/operations.md, "Your own data"), an instruction and a worked example.
        pq.write_table(pa.Table.from_pylist(verl_rows(60, ask=False)), tmp_path / "train.parquet")
        pq.write_table(pa.Table.from_pylist(verl_rows(6, answer=str, ask=False)), tmp_path / "test.parquet")
        trainer = start(*ECHO_RL, "trainer", "--config", str(ROOT / "docs" / "run.toml"), "--nats", hub_url, *SMALL,
                        "--log-json", "task.name=dataset", "task.params.path=train.parquet",
                        "task.params.val_path=test.parquet", "run.eval_every=3", "run.eval_prompts=2",
                        "run.trackers=[tensorboard]", "run.log_completions=true",
                        "task.params.instruction={prompt} Put your final answer in \\boxed{}.",
                        'task.params.examples=[["What is 3 + 4?", "3 + 4 = 7, so \\\\boxed{7}"]]')
        start(*ECHO_RL, "relay", "--hub", f"nats-leaf://127.0.0.1:{leaf}", "--run-id", "arith-1", "--domain", "site-a",
              "--insecure", "--port", str(relay_port))  # 3. beside the hub: another client port
        sampler = start(*ECHO_RL, "sampler", "--nats", f"nats://127.0.0.1:{relay_port}", "--run-id", "arith-1",
                        "--id", "s3", "--set", "sampler.heartbeat_s=0.5")  # 4. the relay's URL and the run id only
        _, trainer_log = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, trainer_log[-3000:]
        lines = [orjson.loads(line) for line in trainer_log.splitlines() if line.startswith("{")]
        assert [line["run_id"] for line in lines if line["event"] == "trainer.ready"] == ["arith-1"]
        assert lines[-1]["event"] == "trainer.finished" and lines[-1]["steps"] == 3
        assert [line["step"] for line in lines if line["event"] == "eval.step"] == [0, 3]  # the base first
        shown = [line for line in lines if line["event"] == "step.completion"]  # TRL's log_completions
        assert [line["step"] for line in shown] == [1, 1, 2, 2, 3, 3]
        assert all(line["prompt"].endswith("? Put your final answer in \\boxed{}.\nassistant\n") for line in shown)
        samples = [orjson.loads(row) for row in (tmp_path / "runs" / "arith-1" / "samples.jsonl").read_bytes().splitlines()]
        assert all("3 + 4 = 7, so \\boxed{7}" in s["prompt"] for s in samples)  # the example, before each

        status = subprocess.run([*ECHO_RL, "status", "--nats", hub_url, "--run-id", "arith-1", "--once", "--json"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)  # 5.
        snap = orjson.loads(status.stdout)
        assert snap["trainer"]["finished"] and snap["samplers"][0]["relay"] == "site-a", snap
        assert sampler.poll() is None  # it waits, in case the run goes on
        run_dir = tmp_path / "runs" / "arith-1"  # 7. results on the trainer's box
        for args in (["report", "--run", str(run_dir)], ["eval", "--run", str(run_dir), "--prompts", "3"],
                     ["replay", "--run", str(run_dir)]):
            done = subprocess.run([*ECHO_RL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (args, done.stderr[-2000:])
        assert (run_dir / "report.png").exists() and (run_dir / "eval.json").exists()
        assert any((run_dir / "tensorboard").iterdir()) and (run_dir / "samples.jsonl").stat().st_size > 0
        assert len(done.stdout.splitlines()) >= 12  # replay: every group of the 3 steps, from the hub
        # Asked for more held-out prompts than the task has: the log counts those scored, and the
        # run's first eval.json is kept (a second eval overwrote it).
        again = subprocess.run([*ECHO_RL, "eval", "--run", str(run_dir), "--prompts", "500", "--log-json"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr[-2000:]
        start = next(orjson.loads(line) for line in again.stderr.splitlines() if '"eval.start"' in line)
        second = orjson.loads((run_dir / "eval-2.json").read_bytes())
        assert start["asked"] == 500 and start["prompts"] == second["prompts"] == 6
        assert start["held_out"] == "6 rows of task.params.val_path"  # why fewer than asked
        assert orjson.loads((run_dir / "eval.json").read_bytes())["prompts"] == 3
    finally:
        stop_processes(list(reversed(processes)), timeout=30)
