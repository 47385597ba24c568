"""The single-file edge sampler (`make worker`, workers/operator/edge_bundle.py) joins a swarm from a box
that has Python and torch and nothing else of this environment."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from echo.train.metrics import read_metrics
from streams.client import open_run
from streams.registry import read_statuses
from tests.conftest import stopped, tiny_config, worker_process
from workers.operator.edge_bundle import BOX_PROVIDES, build, closure

pytestmark = pytest.mark.slow


def box_with_only_torch(directory: Path) -> Path:
    """A directory to put on PYTHONPATH of a `python -S` (no site-packages): torch and what it
    requires, linked from this environment, and nothing else."""
    directory.mkdir()
    for dist in closure([BOX_PROVIDES]).values():
        for top in {entry.parts[0] for entry in dist.files or [] if entry.parts[0] != ".."}:
            if not (directory / top).exists():
                (directory / top).symlink_to(dist.locate_file(top))
    return directory


async def sampler_entry(url: str, run_id: str, sampler_id: str):
    run = await open_run(url, run_id, "test", create=False)
    try:
        return next(s for s in await read_statuses(run) if s.sampler_id == sampler_id)
    finally:
        await run.close()


def test_the_single_file_sampler_joins_a_swarm_from_a_box_with_only_torch(tmp_path, nats_server):
    bundle = tmp_path / "dist" / "echo-sampler"
    description = build(bundle)
    assert "torch" not in description["packages"] and "transformers" in description["packages"]
    box = box_with_only_torch(tmp_path / "box")
    cfg = tiny_config(tmp_path, run={"steps": 3}, nats={"url": nats_server.url})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    env = {**os.environ, "PYTHONPATH": str(box), "ECHO_SAMPLER_CACHE": str(tmp_path / "unpacked")}
    trainer = worker_process(config_path, "trainer")
    sampler = subprocess.Popen(
        [sys.executable, "-S", str(bundle), "--nats", nats_server.url, "--run-id", cfg.run.id, "--id", "edge1",
         "--log-json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, trainer_logs = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, trainer_logs[-3000:]
        assert {g[2] for m in read_metrics(cfg.run_dir) for g in m["groups"]} == {"edge1"}
        sampler.send_signal(signal.SIGTERM)
        _, logs = sampler.communicate(timeout=60)
    finally:
        stopped(trainer, sampler)
    assert sampler.returncode == 0, logs[-3000:]
    lines = [orjson.loads(line) for line in logs.splitlines() if line.startswith("{")]
    ready = next(line for line in lines if line["event"] == "sampler.ready")
    assert (ready["engine"], ready["device"]) == ("hf", "cpu")
    assert lines[-1]["event"] == "sampler.stopped" and "Traceback" not in logs
    assert all((line["run"], line["role"], line["worker"]) == (cfg.run.id, "sampler", "sampler-edge1") for line in lines)
    assert lines[-1]["version"] >= 0  # the version its engine ran last
    last = asyncio.run(sampler_entry(nats_server.url, cfg.run.id, "edge1"))
    assert last.state == "draining" and last.groups_published > 0  # its last heartbeat, written on SIGTERM
    assert [p.name for p in (tmp_path / "unpacked").iterdir()] == [description["id"]]  # unpacked once, in place
