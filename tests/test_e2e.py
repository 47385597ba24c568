"""End to end: `echo-rl up` on the tiny model, a trainer and two samplers as OS processes
joined by a real nats-server. The checks read the run's metrics and its rollout stream."""

import contextlib
import signal
import subprocess
import sys
import threading
import time

import orjson
import psutil
import pytest
import torch
from safetensors.torch import load

from bench.envs import GUESS_ENV
from echo.config import TaskConfig
from echo.tasks import load_task
from echo.wire.names import HDR_MSG_ID, HDR_VERSION
from tests.conftest import eventually
from tests.swarms import (
    OPENENV_GUESS,
    USER_TASK,
    VERIFIERS_ENV,
    assert_every_group_proved,
    run_swarm,
    up_command,
)

pytestmark = pytest.mark.slow

def test_an_on_policy_async_run_trains_within_its_bound_with_importance_ratios_of_one(on_policy_swarm):
    _, metrics, stream, stderr = on_policy_swarm
    assert_within_the_staleness_bound(metrics, stream, stderr, max_staleness=0, steps=6)
    # On-policy: the sampler's mu is the trainer's pi_old, up to float error.
    assert all(abs(m["is_ratio_mean"] - 1) < 1e-4 and abs(m["is_ratio_max"] - 1) < 1e-3 for m in metrics)


def test_async_run_stays_within_the_staleness_bound_of_one(tmp_path):
    """On the tiny mixture of experts with routing replay: every group carries its
    routing, every forward of the trainer replays it, and every group passes the proof, the
    routing check included. And the grpo preset with two updates a batch: the ratio and the clip
    act, proof in-step included."""
    metrics, stream, stderr = run_swarm(tmp_path, "async", 5, "trainer.max_staleness=1", "trainer.verify_fraction=1.0",
                                        "algorithm.preset=grpo", "algorithm.num_iterations=2",
                                        'algorithm.router_replay="replay"', model="tiny-moe")
    assert_within_the_staleness_bound(metrics, stream, stderr, max_staleness=1, steps=5)
    assert all(m["iterations"] == 2 for m in metrics)
    assert all((r["group"]["routing"]["layers"], r["group"]["routing"]["top_k"]) == (2, 2) for r in stream)


def assert_within_the_staleness_bound(metrics: list[dict], stream: list[dict], stderr: str, max_staleness: int,
                                      steps: int) -> None:
    """Every group trained once, sampled within the bound of the version it trained; proof of
    sampling on every group: honest samplers are never taken for forgers."""
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["used"] == 4 for m in metrics), metrics
    assert metrics[-1]["proof_of_sampling"]["passed"] >= 4 * steps and "forged" not in metrics[-1]["proof_of_sampling"]
    assert all(m["rejected"] == {} and m["quarantined"] == [] for m in metrics)
    assert "swarm.done" in stderr and f"step={steps}" in stderr
    version_in_stream = {r["headers"][HDR_MSG_ID]: int(r["headers"][HDR_VERSION]) for r in stream}
    trained = [gid for m in metrics for gid, _, _ in m["groups"]]
    assert len(trained) == len(set(trained)) == 4 * steps  # no group trained twice
    for m in metrics:
        trained_from = m["step"] - 1  # step s trains version s - 1 into version s
        for group_id, version, sampler in m["groups"]:
            assert version_in_stream[group_id] == version  # the stream agrees with the metrics
            assert trained_from - max_staleness <= version <= trained_from
    samplers = {sampler for m in metrics for _, _, sampler in m["groups"]}
    assert samplers <= {"s1", "s2"} and len({r["subject"] for r in stream}) == 2  # one subject per sampler


def test_a_bf16_swarm_trains_with_on_policy_importance_ratios_near_one(tmp_path, monkeypatch):
    """Trainer and samplers in bf16 on the CPU, weights published in bf16: the dtype path a GPU
    swarm takes. At S=0 the ratio pi_old / mu is bf16 rounding only: per-token within 5% of 1
    and 1 +- 0.01 on average (the tiny model measured 0.994-1.006; SmolLM2 0.74-1.39 per token,
    mean 1.000-1.003, see README). Every group passes the proof at the 16-bit tolerance."""
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "shout.py").write_text(USER_TASK)  # rewards that vary within a group: gradients
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_tasks"))
    metrics, stream, _ = run_swarm(tmp_path, "bf16", 5, 'task.name="shout:Shout"', 'task.params={word="hey"}',
                                   "trainer.max_staleness=0", "model.dtype=bfloat16", 'sampling.dtypes=["bfloat16"]',
                                   "trainer.publish_dtype=bfloat16",
                                   "trainer.verify_fraction=1.0")
    assert [m["version"] for m in metrics] == [1, 2, 3, 4, 5] and all(m["used"] == 4 for m in metrics)
    assert all(abs(m["is_ratio_mean"] - 1) < 0.01 and m["is_ratio_max"] < 1.05 for m in metrics), metrics
    assert metrics[-1]["proof_of_sampling"]["passed"] >= 20 and "forged" not in metrics[-1]["proof_of_sampling"]
    groups = [r["group"] for r in stream]
    assert {(g["engine"], g["dtype"]) for g in groups} == {("hf", "bfloat16")}
    oldest, newest = (path.read_bytes() for path in sorted((tmp_path / "bf16" / "weights").iterdir())[::2])
    assert b'"dtype":"BF16"' in newest[:4096] and oldest != newest  # published in bf16, and training moved them


def test_a_trainer_on_two_ranks_trains_publishes_and_its_samplers_follow(tmp_path):
    """`up --trainer-ranks 2`: torchrun's 2 gloo ranks share each step (FSDP2), rank 0 does the
    NATS side and publishes, the samplers follow each version, and every group passes the proof
    of sampling (its forward runs on both ranks). Each rank wrote its shard of the checkpoint."""
    metrics, stream, stderr = run_swarm(tmp_path, "ranks", 4, "trainer.verify_fraction=1.0",
                                        flags=["--trainer-ranks", "2", "--log-json"])
    assert [m["version"] for m in metrics] == [1, 2, 3, 4] and all(m["used"] == 4 for m in metrics), metrics
    ready = [orjson.loads(line) for line in stderr.splitlines() if '"trainer.ready"' in line]
    assert [r["ranks"] for r in ready] == [2]
    assert metrics[-1]["proof_of_sampling"]["passed"] >= 16 and "forged" not in metrics[-1]["proof_of_sampling"]
    assert max(int(r["headers"][HDR_VERSION]) for r in stream) >= 3  # samplers followed the versions
    assert sorted(p.name for p in (tmp_path / "ranks" / "checkpoint" / "step-000004").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


# The paged engine on the direct run, `hf` behind the relay: each path once (a swarm saved).
@pytest.mark.parametrize("relay, engine", [(False, "hf-paged"), (True, "hf")], ids=["direct-paged", "behind-relay"])
def test_sequential_run_trains_only_on_its_current_version(tmp_path, relay, engine):
    """Sequential mode, directly or behind a relay: each step trains on exactly the groups its
    version sampled. On the paged engine too (sampler.engine = "hf-paged", transformers'
    continuous batching, keyed noise drawn through its per-request processor): the trainer
    proves every group's tokens and log-probs (verify_fraction 1) and finds them its own, and
    on-policy its importance ratios are 1."""
    flags = ["--log-json"] + (["--relay"] if relay else [])
    metrics, stream, stderr = run_swarm(tmp_path, "seq", 4, "run.mode=sequential", f'sampler.engine="{engine}"',
                                        "trainer.verify_fraction=1.0", flags=flags)
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["used"] == 4 and m["dropped_stale"] == 0
        assert {version for _, version, _ in m["groups"]} == {m["step"] - 1}
        assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert engine == "hf-paged" or abs(m["is_ratio_max"] - 1) < 1e-3
    assert metrics[-1]["proof_of_sampling"] == {"passed": 16}
    assert sorted(int(r["headers"][HDR_VERSION]) for r in stream) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    logs = [orjson.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert [e["step"] for e in logs if e["event"] == "step" and e["worker"] == "trainer"] == [1, 2, 3, 4]
    assert len(logs) == len(stderr.splitlines())  # every line is JSON


# Each task in one mode, each mode with one task: the pairs the combinations share (80 s of the
# suite saved; the episode loop does not depend on the mode, the grants not on the task). The
# calculator's episodes (math_tools) are played and replayed in test_environments.py, the verifiers
# game's tool calls in test_verifiers_env.py (the tiny random model calls no tool).
@pytest.mark.parametrize("task, mode, extra", [
    ("sokoban_game", "async", ()), ("verifiers:guess_env", "sequential", ()),
    ("openenv:guess_openenv", "async", ('task.params.server="subprocess"',))])
def test_multi_turn_tasks_train_end_to_end(tmp_path, monkeypatch, task, mode, extra):
    """Episodes of Sokoban played move by move, of a `verifiers` ToolEnv (guess the number, with a
    calculator, told higher or lower) and of the same game as an OpenEnv environment, served by
    OpenEnv's own server beside each process: the samplers play them turn by turn with keyed
    noise, the trainer replays each with the sampler's actions (the environment's own code in
    both), proves every group's tokens and trains on the model's tokens; nothing is refused, and
    some episodes went past their first turn."""
    (tmp_path / "user_envs").mkdir()
    (tmp_path / "user_envs" / "guess_env.py").write_text(GUESS_ENV)
    (tmp_path / "user_envs" / "guess_openenv.py").write_text(OPENENV_GUESS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_envs"))
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    run_id = f"{task}-{mode}".replace("_", "-").replace(":", "-")
    metrics, stream, _ = run_swarm(tmp_path, run_id, 3, f"task.name={task}",
                                   f"run.mode={mode}", "sampling.max_new_tokens=256", "task.params.max_turns=3",
                                   "run.eval_prompts=2", "trainer.verify_fraction=1.0", *extra)
    assert [m["version"] for m in metrics] == [1, 2, 3] and all(m["used"] == 4 for m in metrics)
    assert not any(m["rejected"] for m in metrics)
    assert metrics[-1]["proof_of_sampling"]["passed"] >= 12 and "forged" not in metrics[-1]["proof_of_sampling"]
    episodes = [c for r in stream for c in r["group"]["completions"]]
    assert any(c["observations"] for c in episodes)  # a model turn, the board, another turn
    assert all(len(c["observations"]) < 3 for c in episodes)  # at most max_turns turns
    shown = subprocess.run([sys.executable, "-m", "workers.cli", "replay", "--run", str(tmp_path / run_id), "--table"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "      model: " in shown and "      environment: " in shown  # episodes turn by turn
    scored = orjson.loads((tmp_path / run_id / "summary.json").read_bytes())["eval"]  # held-out episodes, played greedily
    assert scored["prompts"] == 2 and 0 <= scored["base_reward"] <= 1 and 0 <= scored["trained_reward"] <= 1


def test_a_secured_swarm_trains_over_tls_with_role_credentials_its_weights_from_a_secured_relay(tmp_path):
    metrics, stream, stderr = run_swarm(tmp_path, "secured", 3, "algorithm.preset=gspo", "trainer.verify_fraction=1.0",
                                        flags=["--secure", "--relay"])
    assert_every_group_proved(metrics)
    assert [m["version"] for m in metrics] == [1, 2, 3] and all(m["used"] == 4 for m in metrics)
    assert not any(m["rejected"] for m in metrics)
    run_dir = tmp_path / "secured"
    assert "permissions violation" not in (run_dir / "nats.log").read_text().lower()
    relay_log = (run_dir / "relay.log").read_text()
    assert "Leafnode connection created" in relay_log and "permissions violation for publish" not in relay_log.lower()
    assert (run_dir / "secure" / "sampler-s2.nk").exists() and (run_dir / "secure" / "relay-site-cert.pem").exists()
    # `status --run` of the finished run (it retried the stopped embedded server's port forever):
    # read from a server on the run's own store, as its observer, and seen finished.
    done = subprocess.run([sys.executable, "-m", "workers.cli", "status", "--run", str(run_dir), "--once",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    trainer = orjson.loads(done.stdout)["trainer"]
    assert trainer["finished"] is True and trainer["step"] == 3


@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_process(tmp_path, stop, code):
    """Ctrl-C, `kill` or `timeout` on `up`: its nats-server, trainer and samplers all stop (a
    SIGTERM once orphaned them, and a later `up` started a second server on the same store)."""
    # Started as a script's `up &` or nohup starts it, SIGINT ignored: Python then installs no
    # handler of its own, and `kill -INT` did nothing (the run went on for as long as CI ran).
    proc = subprocess.Popen(up_command(tmp_path, "stop", 10_000), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    children = []
    for line in proc.stderr:
        children = psutil.Process(proc.pid).children(recursive=True) or children
        if "step=" in line:
            break
    # nats-server, trainer, two samplers; the trainer's scoring process, the fork server it
    # comes from and multiprocessing's resource tracker
    assert len(children) == 7
    # The rest of its output read meanwhile: a pipe nobody reads fills (64 KiB), and every process
    # writing to it, `up` among them, then blocks (it once outlasted the wait below in CI).
    rest = []
    reader = threading.Thread(target=lambda: rest.append(proc.stderr.read()), daemon=True)
    reader.start()
    proc.send_signal(stop)
    signalled = time.monotonic()
    try:
        assert proc.wait(timeout=60) == code
        # Within seconds, not up's 20 s deadline for the stragglers it kills (both
        # samplers hung till then), each process saying it stopped.
        assert time.monotonic() - signalled < 5
        reader.join(timeout=10)
        said = "".join(rest)
        assert "swarm.kill" not in said and said.count("sampler.stopped") == 2 and "trainer.stopped" in said, said
        # Each gone, or a zombie its parent left.
        eventually(lambda: not [c for c in children if _alive(c)], 30, 0.05,
                   why=lambda _: [c for c in children if _alive(c)])
    finally:  # a swarm left running would load every test after this one
        for p in [proc, *children]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between the two questions
        return False



def test_sigterm_during_the_final_evaluation_stops_it_in_one_line(tmp_path):
    """SIGTERM while `up` scored the held-out set printed a KeyboardInterrupt traceback. The run
    is trained and kept; only its evaluation is cut short. (Held-out completions of up to 2,048
    tokens: the evaluation outlasts the signal's delivery on any CPU.)"""
    proc = subprocess.Popen(up_command(tmp_path, "evals", 1, "run.eval_prompts=50", "sampling.max_new_tokens=2048"),
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "eval.start" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 143, "".join(seen)[-3000:] + rest
    assert "Traceback" not in rest and "swarm.interrupted" in rest and "evaluation" in rest, rest
    assert (tmp_path / "evals" / "metrics.jsonl").exists() and not (tmp_path / "evals" / "eval.json").exists()


def test_a_sequential_run_is_reproducible_from_its_config(tmp_path, monkeypatch):
    """Each process seeded its sampling noise at random, so no run could be reproduced from its
    config. With one sampler in sequential mode (which slot a group fills is then the same every
    time), two runs of one config sample the same completions in the same order (they differed
    with each sampler's noise unseeded), and publish the same weights up to float rounding: the
    CPU's kernels do not promise the same last bit from one process to the next (behaviour
    log-probs were seen 1e-6 apart on a loaded box). Rewards that vary within a group (the
    user's task), so the noise moves the adapter."""
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "shout.py").write_text(USER_TASK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_tasks"))

    def run(name: str) -> tuple[bytes, dict]:
        cmd = up_command(tmp_path / name, "same", 2, "run.mode=sequential", "sampler.count=1", "run.seed=0",
                         'task.name="shout:Shout"', 'task.params={word="hey"}')
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = tmp_path / name / "same"
        return (run_dir / "trained_content.txt").read_bytes(), load(
            sorted((run_dir / "weights").glob("v*.safetensors"))[-1].read_bytes())

    (content_a, weights_a), (content_b, weights_b) = run("a"), run("b")
    assert content_a == content_b and content_a.count(b"\n") == 8  # the same groups, in the same order
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.allclose(weights_a[k], weights_b[k], rtol=1e-4, atol=1e-7) for k in weights_a)


def test_a_users_verifiers_environment_trains_end_to_end(tmp_path, monkeypatch):
    """A user's module on PYTHONPATH in every process, written to `verifiers`' interface (a user's
    module:Class task trains in the full-weight test below): its rows are the prompts, its rubric
    scores on the trainer, its eval dataset is held out."""
    (tmp_path / "user_envs").mkdir()
    (tmp_path / "user_envs" / "sums_env.py").write_text(VERIFIERS_ENV)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_envs"))
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    metrics, stream, _ = run_swarm(tmp_path, "user", 2, 'task.name="verifiers:sums_env"', "task.params={n=50}",
                                   "run.eval_prompts=4", "algorithm.preset=dapo", "trainer.verify_fraction=1.0")
    assert [m["version"] for m in metrics] == [1, 2]
    assert_every_group_proved(metrics)
    # DAPO's dynamic sampling: groups with no reward spread were set aside, not trained (unless
    # its bound of 32 a step ran out), and counted.
    assert all(m["zero_spread_share"] == 0 or m["filtered_no_signal"] == 32 for m in metrics)
    assert metrics[-1]["accounting"]["filtered_no_signal"] == sum(m["filtered_no_signal"] for m in metrics)
    assert {r["headers"]["Echo-Task"] for r in stream} == {"verifiers:sums_env"}
    # The rubric's rewards, on [0, 1]: the format function gives every completion some, the shout some more.
    rewards = [m["reward_mean"] for m in metrics]
    assert all(0 < r <= 1 for r in rewards)
    assert metrics[-1]["accounting"]["rejected"] == 0 and not any(m["verifier_errors"] for m in metrics)
    summary = orjson.loads((tmp_path / "user" / "summary.json").read_bytes())
    assert summary["eval"]["task"] == "verifiers:sums_env" and summary["eval"]["prompts"] == 4  # its eval rows
    # Each process's peak memory, from its exit (wait4): a model and torch each, so over 100 MB.
    assert summary["peak_rss_mb"].keys() == {"trainer", "s1", "s2"} and min(summary["peak_rss_mb"].values()) > 100
    assert (tmp_path / "user" / "report.png").stat().st_size > 10_000


def test_a_swarm_trains_on_a_composite_of_two_reasoning_gym_datasets(tmp_path):
    """The trainer re-derives each group's problem from its index and scores it itself."""
    datasets = '[{name="chain_sum", weight=1, config={max_terms=3}}, {name="shortest_path", weight=1}]'
    metrics, stream, _ = run_swarm(tmp_path, "gym", 2, 'task.name="reasoning_gym:composite"',
                                   f"task.params={{datasets={datasets}}}", "run.eval_prompts=4",
                                   "algorithm.preset=dr_grpo", "trainer.verify_fraction=1.0")
    assert_every_group_proved(metrics)
    assert [m["version"] for m in metrics] == [1, 2]
    assert {r["headers"]["Echo-Task"] for r in stream} == {"reasoning_gym:composite"}
    task = load_task(TaskConfig(name="reasoning_gym:composite", params={"datasets": [
        {"name": "chain_sum", "config": {"max_terms": 3}}, {"name": "shortest_path"}]}))
    drawn = {task.prompt(r["group"]["prompt_index"]).answer.split("/")[0] for r in stream}
    assert drawn == {"chain_sum", "shortest_path"}
    assert metrics[-1]["accounting"]["rejected"] == 0  # every prompt was the trainer's own
    summary = orjson.loads((tmp_path / "gym" / "summary.json").read_bytes())
    assert summary["eval"]["task"] == "reasoning_gym:composite" and summary["eval"]["prompts"] == 4


def test_full_weight_mode_on_two_ranks_trains_and_publishes_every_parameter_in_shards(tmp_path, monkeypatch):
    """The model is sharded and each shard of a version is gathered on rank 0 alone. (Full weights
    in one process: the delta test below.)"""
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "shout.py").write_text(USER_TASK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_tasks"))
    metrics, stream, _ = run_swarm(tmp_path, "full", 3, 'task.name="shout:Shout"', 'task.params={word="hey"}',
                                   "lora.enabled=false", "trainer.shard_mb=0.05", "run.eval_prompts=2",
                                   "trainer.verify_fraction=1.0", flags=["--trainer-ranks", "2"])
    assert [m["version"] for m in metrics] == [1, 2, 3]
    # Every group's proof of sampling, on sharded full weights too (it copied a version's tensors into
    # the root's parameters, which FSDP2 leaves whole after a forward: it crashed the ranks).
    assert metrics[-1]["proof_of_sampling"] == {"passed": sum(m["used"] for m in metrics)}
    assert max(int(r["headers"][HDR_VERSION]) for r in stream) >= 1  # samplers loaded new full weights
    files = sorted(p.name for p in (tmp_path / "full" / "weights").iterdir())
    assert {f[:7] for f in files} == {"v000001", "v000002", "v000003"}  # the newest keep_versions = 3
    first, last = ([(tmp_path / "full" / "weights" / f).read_bytes() for f in files if f.startswith(v)]
                   for v in ("v000001", "v000003"))
    assert len(last) > 3 and first != last  # several shards, and training moved them
    assert orjson.loads((tmp_path / "full" / "summary.json").read_bytes())["eval"]["version"] == 3


def test_full_weights_sent_as_deltas_through_a_relay_are_rebuilt_bit_for_bit_by_the_sampler(tmp_path, monkeypatch):
    """Full weights in bf16, sequential mode with one sampler, so every version reaches the
    sampler: it rebuilds each from deltas through a relay's mirror and swaps in only weights
    whose digest (of every tensor's bits) is the one the trainer announced for the whole
    version, so nothing refused means every version rebuilt bit for bit; and every group it
    sampled with them passed the proof of sampling. (Comparing with a second run sent whole
    asked two processes for the same last bit of float arithmetic, which a loaded box does
    not give.)"""
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "shout.py").write_text(USER_TASK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user_tasks"))
    metrics, stream, _ = run_swarm(tmp_path, "full", 5, "run.mode=sequential", "sampler.count=1",
                                   'task.name="shout:Shout"', 'task.params={word="hey"}', "lora.enabled=false",
                                   "trainer.publish_dtype=bfloat16", "trainer.lr=1e-5", "trainer.delta_every=3",
                                   "trainer.verify_fraction=1.0", flags=["--relay"], samplers={"s1"})
    # Version 0 whole (the first), then deltas, whole again at 3 (delta_every), a delta after it.
    assert [m["weights"]["delta_of"] for m in metrics] == [0, 1, None, 3, 4]
    whole = metrics[2]["weights"]["bytes"]
    assert all(m["weights"]["bytes"] < whole / 3 for m in metrics if m["weights"]["delta_of"] is not None)  # 14-26%
    # Sequential: each step's groups were sampled with the version before it, rebuilt from its delta.
    assert sorted(int(r["headers"][HDR_VERSION]) for r in stream) == [v for v in range(5) for _ in range(4)]
    assert metrics[-1]["proof_of_sampling"] == {"passed": sum(m["used"] for m in metrics)}
