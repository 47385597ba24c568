"""`echo-rl replay`: filters over a finished run's stream, and `--retrain`, which trains again
over exactly the groups each step consumed and must reproduce the published adapter bit for bit."""

import subprocess
import sys

import orjson
import pytest

from tests.test_e2e import run_swarm

pytestmark = pytest.mark.slow


def _replay(run_dir, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "replay", "--run", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=180)


def test_replay_filters_and_a_retrain_reproduces_the_published_adapter_bit_for_bit(tmp_path):
    metrics, stream, _ = run_swarm(tmp_path, "again", 6, "trainer.max_staleness=0")
    run_dir = tmp_path / "again"

    done = _replay(run_dir, "--retrain")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = orjson.loads(done.stdout)
    assert report == {"steps": 6, "version": 6, "published_version": 6, "identical": True}

    sampler, version = stream[-1]["group"]["sampler_id"], stream[-1]["group"]["policy_version"]
    records = [orjson.loads(line) for line in _replay(run_dir, "--sampler", sampler, "--version", str(version)).stdout.splitlines()]
    expected = [r for r in stream if r["group"]["sampler_id"] == sampler and r["group"]["policy_version"] == version]
    assert [r["seq"] for r in records] == [r["seq"] for r in expected] and expected
    assert [orjson.loads(x)["seq"] for x in _replay(run_dir, "--seq", "2:4").stdout.splitlines()] == [2, 3, 4]
    assert _replay(run_dir, "--rejected").stdout == ""  # an honest run: nothing malformed
    everything = _replay(run_dir, "--reward", "0:1", "--table").stdout.splitlines()
    assert len(everything) == len(stream) and all(" completions " in line for line in everything)
