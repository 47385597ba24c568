"""`echo-rl status` on a live swarm: the trainer and every sampler, from the broker alone."""

import asyncio
import io
import re
import signal
import subprocess
import sys
import time
from urllib.error import HTTPError
from urllib.request import urlopen

import orjson
import pytest
from rich.console import Console

from echo.wire.messages import SamplerStatus, TrainerStatus
from streams.client import open_run
from tests.conftest import eventually, next_event, serving, stopped, tiny_config, worker_process
from tests.swarms import up_command
from workers.operator.snapshot import fleet_summary, pace_s, sampler_row
from workers.operator.status import engine_cell, progress, render

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
        seen = []

        def beating():  # each sampler's heartbeat names the weights it runs and what it published
            seen.append(orjson.loads(_status(tmp_path / "live", "--json")))
            samplers = seen[-1]["samplers"]
            return len(samplers) == 2 and all(s["lag"] is not None and s["groups_published"] > 0 for s in samplers)

        eventually(beating, 60, every=0.2, why=lambda _: seen[-1])
        snap = seen[-1]
        trainer = snap["trainer"]
        assert trainer["term"] >= 1 and trainer["step"] >= 1 and trainer["version"] == trainer["step"]
        assert len(trainer["rewards"]) >= 1 and 0 < trainer["utilisation"] <= 1
        assert trainer["steps"] == 10_000 and trainer["elapsed_s"] > 0 and trainer["eta_s"] > 0
        assert trainer["model"] == "tiny" and trainer["task"] == "math" and not trainer["overdue"]
        charted = {"loss", "kl", "entropy", "grad_norm", "lr", "length_mean", "zero_spread_share"}
        assert charted <= set(trainer["scalars"])
        assert len(trainer["samples"]) == 2 and all(s["sampler"] in ("s1", "s2") for s in trainer["samples"])
        assert trainer["accounting"]["trained"] >= 4 and trainer["rejected"] == {}
        assert {s["id"] for s in snap["samplers"]} == {"s1", "s2"}
        for s in snap["samplers"]:
            assert s["state"] == "active" and s["engine"] == "hf" and s["relay"] == "hub"
            assert s["lag"] is not None and s["lag"] >= 0 and s["groups_published"] > 0
            assert s["slots_undelivered"] == 0 <= s["slots_ended"]  # honest, no fault: every slot delivered
        assert snap["stream"]["messages"] > 0 and snap["relays"] == {"hub": ["s1", "s2"]}
        assert snap["storage"]["bytes"] >= snap["stream"]["bytes"] and snap["storage"]["limit"] is None
        view = _status(tmp_path / "live")  # the terminal view, printed once
        assert "s1" in view and "s2" in view and "learner busy" in view and "undelivered" in view
        assert re.search(r"samplers +(active|standby) \d", view), view  # summed up first
        assert re.search(r"step \d+/10000, elapsed \S+, ETA \S+", view), view
        with serving(tmp_path / "live") as url:  # the live page: its events, each a snapshot
            assert b"echo-rl status" in urlopen(url).read()
            with pytest.raises(HTTPError, match="404"):
                urlopen(url + "../config.toml")  # the page and its two files, nothing else
            events = urlopen(url + "events", timeout=60)
            first, later = next_event(events), next_event(events)
            while later["trainer"]["step"] == first["trainer"]["step"]:
                later = next_event(events)
            assert set(later) == {"run_id", "at", "trainer", "samplers", "fleet", "stream", "storage", "relays",
                                 "steps", "config", "evals", "samples"}  # the last two: served with --run
            assert later["fleet"]["samplers"] == 2 and set(later["fleet"]["slowest"]) <= {"s1", "s2"}
            assert later["evals"] == [] and {s["sampler"] for s in later["samples"]} <= {"s1", "s2"}
            assert later["config"]["run"]["id"] == "live" and later["config"]["model"]["name"] == "tiny"
            assert {s["id"] for s in later["samplers"]} == {"s1", "s2"}
            assert [p["step"] for p in later["steps"]][-1] == later["trainer"]["step"] > first["trainer"]["step"]
            # Served on the trainer's machine: the charts begin at the run's first step, read from its
            # metrics (the page server started after step 3), each point with the values charted.
            assert later["steps"][0]["step"] == 1
            assert all({"reward", "loss", "kl", "lr", "length", "staleness"} <= set(p) for p in later["steps"])
    finally:
        stopped(proc, sig=signal.SIGINT)



def test_the_end_of_a_secured_standalone_run_is_seen_from_its_run_directory(tmp_path, secured):
    """A standalone trainer exited without a summary, its samplers stayed "active" and `status`
    showed the last step as if live; `status --run DIR` ignored the credentials in the run's
    config (a certificate error, retried for 10 minutes) and `replay --run DIR` refused a run
    whose rollouts live on a hub. Now the trainer's last line is the summary, the run is marked
    finished, its sampler says so in its heartbeat, and both commands read the run from its
    directory alone."""
    server, secure = secured
    trainer_creds, sampler_creds = secure.credentials("trainer"), secure.credentials("sampler-s1")
    cfg = tiny_config(tmp_path, run={"id": "sec", "steps": 2}, sampler={"heartbeat_s": 0.5},
                      nats={"url": server.url, "creds": str(trainer_creds.seed_file), "tls_ca": str(trainer_creds.ca_file)})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer = worker_process(config_path, "trainer")
    sampler = worker_process(config_path, "sampler", "--id", "s1", "--creds", str(sampler_creds.seed_file))
    run_dir = cfg.run_dir  # its config names the hub and the trainer's credentials
    try:
        _, trainer_log = trainer.communicate(timeout=180)
        assert trainer.returncode == 0, trainer_log[-3000:]
        last = orjson.loads(trainer_log.strip().splitlines()[-1])
        assert last["event"] == "trainer.finished" and last["steps"] == 2 and "reward_last5" in last
        # Its next heartbeats say it.
        snap = eventually(lambda: (s := orjson.loads(_status(run_dir, "--json")))["samplers"][0]["state"] == "finished"
                          and s, 30, 0.5, why=lambda _: _status(run_dir, "--json"))
        assert snap["trainer"]["finished"] is True and snap["trainer"]["step"] == 2
        assert "finished at step 2" in _status(run_dir)
    finally:
        for p in (trainer, sampler):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _, sampler_log = sampler.communicate(timeout=60)
    assert any(orjson.loads(line).get("event") == "sampler.run_finished" for line in sampler_log.splitlines()
               if line.startswith("{"))
    replayed = subprocess.run([sys.executable, "-m", "workers.cli", "replay", "--run", str(run_dir)],
                              capture_output=True, text=True, timeout=60)
    assert replayed.returncode == 0 and len(replayed.stdout.splitlines()) >= 8, replayed.stderr[-2000:]


def test_progress_reads_as_steps_of_the_run_and_a_trainer_is_late_only_past_its_pace():
    trainer = {"step": 7, "steps": 20, "elapsed_s": 190.0, "eta_s": 3725.0, "finished": False, "seen_s_ago": 41.0,
               "pace_s": 41.0, "overdue": False}
    assert progress(trainer) == "step 7/20, elapsed 3m10s, ETA 1h02m"  # in the middle of a 41 s step: not late
    assert progress(trainer | {"seen_s_ago": 95.0, "overdue": True}).endswith(
        "; no step for 1m35s, a step takes about 41s")
    assert progress(trainer | {"finished": True, "step": 20}) == "finished at step 20/20 (41 s ago)"
    assert progress(trainer | {"steps": 0}) == "step 7, elapsed 3m10s"  # a status from before schema 22
    status = TrainerStatus(step_s=30.0, groups_per_step=4, max_staleness=1, version=7, utilisation=0.75,
                           updated_at=0.0)
    assert pace_s(status) == 40.0  # busy 30 s of each 40 s step


def test_a_split_samplers_engine_says_its_ranks_and_why_their_group_was_last_lost():
    """A sampler's engine cell (status, and the page alike): one rank, the engine alone; split, how
    many ranks, and after a lost group how many times and why the last time."""
    beat = SamplerStatus(sampler_id="s1", version=3, groups_published=0, weight_failures={}, updated_at=1.0,
                         engine="mlx")
    row = sampler_row(beat, 3, {}, None, 2.0)
    assert engine_cell(row) == "mlx"
    assert engine_cell(row | {"ranks": 2}) == "mlx x2"
    lost = sampler_row(beat.model_copy(update={"ranks": 2, "ranks_restarted": 1,
                                               "rank_lost": "rank 1 exited with code -9"}), 3, {}, None, 2.0)
    assert engine_cell(lost) == "mlx x2, restarted 1: rank 1 exited with code -9"


def test_a_thousand_samplers_are_summed_up_with_the_slowest_listed_and_every_one_on_asking():
    """A fleet at scale: at 1,000 samplers the view is a summary (how many in each state, the spread of
    pace and lag) and the ten slowest active ones, not 1,000 lines; `--all` lists each."""
    now = time.time()
    states = ["active"] * 900 + ["standby"] * 60 + ["draining"] * 40
    beats = [SamplerStatus(sampler_id=f"s{i:04d}", version=10 - i % 3, groups_published=i, weight_failures={},
                           updated_at=now, state=state, groups_per_s=0.01 * (1 + (i * 7919) % 1000))
             for i, state in enumerate(states)]
    rows = [sampler_row(b, 10, {}, None, now) for b in beats]
    fleet = fleet_summary(rows)
    assert fleet["samplers"] == 1000 and fleet["by_state"] == {"active": 900, "draining": 40, "standby": 60}
    active = sorted((r["groups_per_s"], r["id"]) for r in rows if r["state"] == "active")
    assert fleet["slowest"] == [i for _, i in active[:10]]
    assert fleet["groups_per_s"]["p50"] == active[450][0] and fleet["lag"] == {"p10": 0, "p50": 1, "p90": 2}
    snap = {"run_id": "r", "at": now, "trainer": None, "samplers": rows, "stream": None,
            "storage": {"bytes": 0, "limit": None}, "relays": {}, "fleet": fleet}
    summed, every = io.StringIO(), io.StringIO()
    Console(file=summed, width=200).print(render(snap))
    Console(file=every, width=200).print(render(snap, every=True))
    assert "active 900, draining 40, standby 60" in summed.getvalue()
    assert "the 10 slowest active of 1000 samplers" in summed.getvalue()
    listed = re.findall(r"\bs\d{4}\b", summed.getvalue())
    assert listed == fleet["slowest"], listed  # slowest first
    assert len(summed.getvalue().splitlines()) < 40 and len(re.findall(r"\bs\d{4}\b", every.getvalue())) == 1000


def test_a_page_served_before_its_run_begins_waits_for_the_trainer(nats_server):
    """As a sampler does: `status --serve` on a run no trainer has created yet waits, and serves
    the page once the run is there (it exited at once, 'not on this broker')."""
    page = subprocess.Popen([sys.executable, "-m", "workers.cli", "status", "--nats", nats_server.url, "--run-id",
                             "later", "--serve", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # waiting, not refused
            page.wait(timeout=3)

        async def begin():
            run = await open_run(nats_server.url, "later", "trainer")  # what a trainer creates
            await run.close()

        asyncio.run(begin())
        serving = page.stdout.readline()  # once the run is there
        assert serving.startswith("echo-rl status: serving http://127.0.0.1:"), serving
        assert b"echo-rl status" in urlopen(re.search(r"http://\S+/", serving)[0]).read()
    finally:
        stopped(page, sig=signal.SIGTERM, timeout=30)
