"""`echo-rl status` on a live swarm: the trainer and every sampler, from the broker alone."""

import signal
import subprocess
import sys
import time

import orjson
import pytest

from tests.test_e2e import up_command

pytestmark = pytest.mark.slow


def _status(run_dir, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "workers.cli", "status", "--run", str(run_dir), "--once", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_status_shows_the_trainer_and_every_sampler_of_a_live_swarm(tmp_path):
    proc = subprocess.Popen(up_command(tmp_path, "live", 10_000, "sampler.heartbeat_s=0.5"), stderr=subprocess.PIPE,
                            text=True)
    try:
        steps = 0
        for line in proc.stderr:
            steps += "step=" in line
            if steps == 3:
                break
        time.sleep(1.0)  # two heartbeats since: each sampler's entry names the weights it runs
        snap = orjson.loads(_status(tmp_path / "live", "--json"))
        trainer = snap["trainer"]
        assert trainer["epoch"] >= 1 and trainer["step"] >= 1 and trainer["version"] == trainer["step"]
        assert len(trainer["rewards"]) >= 1 and 0 < trainer["learner_busy"] <= 1
        assert trainer["accounting"]["trained"] >= 4 and trainer["rejected"] == {}
        assert {s["id"] for s in snap["samplers"]} == {"s1", "s2"}
        for s in snap["samplers"]:
            assert s["state"] == "active" and s["engine"] == "hf" and s["relay"] == "hub"
            assert s["lag"] is not None and s["lag"] >= 0 and s["groups_published"] > 0
        assert snap["stream"]["messages"] > 0 and snap["relays"] == {"hub": ["s1", "s2"]}
        view = _status(tmp_path / "live")  # the terminal view, printed once
        assert "s1" in view and "s2" in view and "learner busy" in view
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
