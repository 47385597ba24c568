"""`echo-rl replay`: filters over a finished run's stream, and `--retrain`, which trains again
over exactly the groups each step consumed and must reproduce the published adapter bit for bit."""

import signal
import subprocess
import sys

import orjson
import pytest

from echo.model.loading import load_tokenizer
from echo.train.metrics import read_metrics
from streams.server import NatsServer
from tests.conftest import a_sampler_holding_slots, assert_balanced, wait_for_steps, worker_process

pytestmark = pytest.mark.slow


def _records(jsonl: str) -> list[dict]:
    # Lines end at "\n" only: generated text may hold U+0085 or U+2028, which str.splitlines splits at.
    return [orjson.loads(line) for line in jsonl.split("\n") if line]


def _replay(run_dir, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "replay", "--run", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=180)


def test_replay_filters_a_finished_runs_stream(on_policy_swarm):
    run_dir, metrics, stream, _ = on_policy_swarm

    sampler, version = stream[-1]["group"]["sampler_id"], stream[-1]["group"]["version"]
    records = _records(_replay(run_dir, "--sampler", sampler, "--version", str(version)).stdout)
    expected = [r for r in stream if r["group"]["sampler_id"] == sampler and r["group"]["version"] == version]
    assert [r["seq"] for r in records] == [r["seq"] for r in expected] and expected
    assert [r["seq"] for r in _records(_replay(run_dir, "--seq", "2:4").stdout)] == [2, 3, 4]
    honest = _replay(run_dir, "--rejected")
    assert honest.stdout == "" and honest.returncode == 1  # an honest run: nothing malformed, and it says so
    assert f"none of the stream's {len(stream)} records matched" in honest.stderr
    assert _replay(run_dir, "--version", "999").returncode == 1  # a version not in the stream: printed nothing, rc 0
    everything = _replay(run_dir, "--reward", "0:1", "--table").stdout.split("\n")[:-1]
    heads = [line for line in everything if not line.startswith(("    [", "    prompt: "))]
    assert len(heads) == len(stream) and all(" completions " in line for line in heads)
    # Its prompt's end, then each completion's text, decoded by the run's tokenizer from its tokens
    # (not the sampler's claim).
    tokenizer = load_tokenizer("tiny")
    first = stream[0]["group"]
    assert everything[1] == f"    prompt: {tokenizer.decode(first['prompt_token_ids'])[-300:]!r}"
    first = first["completions"]
    assert everything[2:2 + len(first)] == [
        f"    [{i}] claimed reward {c['claimed_reward']:.3f} {c['finish_reason']}: "
        f"{tokenizer.decode(c['token_ids'])!r}"
        for i, c in enumerate(first)]


def test_a_retrain_reproduces_an_async_run_that_dropped_stale_groups(tmp_path):
    """A sampler frozen (SIGSTOP) while it holds slots goes silent; the trainer hands its slots
    to the other and steps on; thawed, it delivers groups of an old version, which are dropped as
    stale. The retrain, from the finished run's directory (its broker's store is in it, as with
    `up`), trains on what each step used, in order, and matches the run bit for bit."""
    run_dir = tmp_path / "runs" / "test"  # tiny_config's
    with NatsServer(run_dir / "nats") as server, \
            a_sampler_holding_slots(tmp_path, server.url, 6, dead_after_s=2.0) as (cfg, config_path, processes):
        trainer, slow = processes
        slow.send_signal(signal.SIGSTOP)  # holding slots 3 and 4 of step 1
        processes.append(fast := worker_process(config_path, "sampler", "--id", "s1"))
        wait_for_steps(cfg.run_dir, 3, [trainer, fast])
        # s1 frozen in turn: the trainer cannot finish before s2's groups of version 0 arrive
        # (at version 3 or later); then s2 finishes the run.
        fast.send_signal(signal.SIGSTOP)
        slow.send_signal(signal.SIGCONT)
        logs = trainer.communicate(timeout=180)[1]
        assert trainer.returncode == 0, logs[-3000:]
    assert cfg.run_dir == run_dir
    metrics = read_metrics(run_dir)
    dropped = [g for m in metrics for g in m["dropped_groups"]]
    assert len(dropped) >= 2 and sum(m["dropped_stale"] for m in metrics) == len(dropped), metrics
    assert_balanced(metrics)

    done = _replay(run_dir, "--retrain")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert orjson.loads(done.stdout) == {"steps": 6, "version": 6, "published_version": 6, "identical": True}
