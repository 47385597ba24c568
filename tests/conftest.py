"""Shared fixtures: a real nats-server per test on a free loopback port with a temp store, and
`async def` tests: each runs on an event loop of its own, and the runs it opened through the
`runs` fixture are closed on that loop when it ends, failed or not."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import orjson
import pytest
import structlog
import torch

from echo.config import EchoConfig, validate_config
from echo.engines.hf import HFEngine
from echo.model.loading import base_model_digest
from echo.train.metrics import read_metrics
from echo.weights.shards import weights_shards
from echo.wire.codec import encode
from echo.wire.messages import WeightsAnnouncement, WeightsShard
from echo.wire.names import weights_object_name
from streams.client import RunClient, open_run
from streams.grants import slots_granted
from streams.registry import read_statuses
from streams.secure import SecureDir
from streams.server import LISTEN_PORTS, PORTS_ENV, NatsServer, ServerConfig, free_port
from streams.weights import WeightsPublisher
from workers.operator.relay import loopback_relay_args
from workers.operator.swarm import stop_processes, worker_command
from workers.trainer.accounting import count_consumed, settle
from workers.trainer.intake import Collector

TINY_BASE = base_model_digest("tiny")  # what weights for the tiny model are announced for

# `make test` runs two test processes at once (pytest-xdist): each picks its servers' ports from
# its own slice, as do the swarms it starts, so no two pick one port between the pick and the bind.
if "PYTEST_XDIST_WORKER" in os.environ:
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _slice = len(LISTEN_PORTS) // _workers
    os.environ[PORTS_ENV] = f"{LISTEN_PORTS.start + _worker * _slice}-{LISTEN_PORTS.start + (_worker + 1) * _slice - 1}"


def pytest_addoption(parser):
    parser.addoption("--compose", action="store_true", help="run the Docker compose swarm's test (make test-compose)")
    parser.addoption("--browser", action="store_true", help="run the status page in Chromium (make test-browser)")


# Tests that need what `make test` does not install, each run by its own make target.
OPT_IN = {"compose": "needs Docker and root: make test-compose runs it",
          "browser": "needs Chromium: make test-browser runs it"}


def pytest_collection_modifyitems(config, items):
    for marker, reason in OPT_IN.items():
        if config.getoption(f"--{marker}"):
            continue
        for item in items:
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
    # The files with the most end-to-end swarms first (a stable sort: each file's own order kept),
    # so that `make test`'s two test processes (a file each at a time) finish together instead
    # of one running a long file alone at the end.
    swarms = collections.Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -swarms[item.path])


@pytest.fixture(scope="session")
def on_policy_swarm(tmp_path_factory):
    """One finished `echo-rl up` run that several tests read (a swarm costs ~20 s): async at
    max_staleness 0, 6 steps, every group's proof of sampling checked. Read it, never change it."""
    from tests.swarms import run_swarm  # tests/swarms.py imports this module

    tmp_path = tmp_path_factory.mktemp("on-policy")
    metrics, stream, stderr = run_swarm(tmp_path, "on-policy", 6, "trainer.max_staleness=0",
                                        "trainer.verify_fraction=1.0")
    return tmp_path / "on-policy", metrics, stream, stderr


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """Logging configured by a test (the CLI's commands set level "error") is put back after it:
    else a later test's capture_logs sees no warning (test_faults failed so in the suite only)."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


@pytest.fixture
def nats_server(tmp_path):
    with NatsServer(tmp_path / "jetstream") as server:
        yield server


def alive(pid: int) -> bool:
    """Running (Linux; a zombie waiting for its reaper is not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.fixture
def secured(tmp_path):
    """A hub that speaks TLS only, with trainer, observer and sampler s1 credentials for run "sec"."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost", "127.0.0.1"], ["s1"])
    # Not tmp_path/jetstream: the `runs` fixture's (unused) nats-server keeps its store there.
    with NatsServer(tmp_path / "secured-jetstream", ServerConfig(include=secure.dir / "server.conf")) as server:
        yield server, secure


class Runs:
    """The runs and connections an async test opened (on `url`, the test's server unless it
    names another), closed when the test ends, passed or failed, the last opened first; and
    whatever else it asked to be undone then (`later`)."""

    def __init__(self, url: str):
        self.url, self.closers = url, []

    async def open(self, run_id: str, client_name: str = "test", url: str | None = None, **options) -> RunClient:
        run = await open_run(url or self.url, run_id, client_name, **options)
        self.closers.append(run.close)
        return run

    async def connect(self, **options) -> nats.NATS:
        """A bare NATS connection to the test's server."""
        nc = await nats.connect(self.url, **options)
        self.closers.append(nc.close)
        return nc

    def later(self, undo) -> None:
        """`await undo()` when the test ends, before what was opened before this call is closed."""
        self.closers.append(undo)

    async def close(self) -> None:
        while self.closers:
            await self.closers.pop()()


@pytest.fixture
def runs(nats_server):
    return Runs(nats_server.url)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """An `async def` test runs on a fresh event loop; its `runs` (any Runs it is given) are
    closed on that loop, also when the test fails (a run left open would keep its connections
    and tasks to the end)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

    async def main():
        try:
            await pyfuncitem.obj(**args)
        finally:
            for opened in args.values():
                if isinstance(opened, Runs):
                    await opened.close()

    asyncio.run(main())
    return True


def tiny_config(tmp_path, **sections) -> EchoConfig:
    """A config for the tiny model with small batches, runs under tmp_path."""
    data = {
        "run": {"id": "test", "dir": str(tmp_path / "runs"), "steps": 5},
        "model": {"name": "tiny"},
        "lora": {"r": 4, "alpha": 8.0},
        "sampling": {"group_size": 4, "max_new_tokens": 8, "prompts_per_call": 2},
        "trainer": {"groups_per_step": 4, "threads": 1},
        "sampler": {"threads": 1},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return validate_config(data)


def assert_balanced(metrics: list[dict], stream: list[dict] | None = None, broker_crashed: bool = False) -> None:
    """After every step, each rollout message published is trained, dropped, rejected or pending,
    and counted once. A broker killed mid-run may offer counted messages again (its consumer
    state on disk lags): they show in `pending` too until the trainer has skipped them. No
    retention limit is reached in these runs: a message neither counted nor pending would show
    as `evicted`, except where the readers' counts are not to be trusted (a broker crashed) or
    an earlier timeline acked messages above the readers' lowest ack floor (`abandoned`: those
    show as `evicted` once the floor passes them, a known limit of the per-sampler readers)."""
    assert "accounting" in metrics[-1]
    for m in metrics:
        if m.get("restored"):
            continue  # a line restored from the checkpoint: the trainer died before writing it
        a = m["accounting"]
        assert (a["trained"] + a["dropped_stale"] + a["rejected"] + a.get("filtered_no_signal", 0) + a.get("abandoned", 0)
                + a.get("evicted", 0) == a["counted"]), m
        assert a.get("evicted", 0) == 0 or broker_crashed or a.get("abandoned", 0), m
        if broker_crashed:
            assert a["published"] <= a["counted"] + a["pending"], m
        else:
            assert a["published"] == a["counted"] + a["pending"] and a["unconfirmed_acks"] == 0, m
    assert metrics[-1]["accounting"]["trained"] == sum(m["used"] for m in metrics)
    if stream is not None:
        assert metrics[-1]["accounting"]["published"] <= len(stream)  # samplers may publish on till they stop


def worker_process(config_path, *args, ranks: int = 1) -> subprocess.Popen:
    """`echo-rl <args> --config <config_path>` as its own OS process (torchrun's `ranks`
    processes), logging JSON to a pipe."""
    return subprocess.Popen(worker_command([*args, "--config", str(config_path), "--log-json"], ranks),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_trainer_and_sampler(tmp_path, cfg: EchoConfig, sampler_id: str, timeout: float, meanwhile=lambda: None):
    """A trainer and one sampler as processes on `cfg`: call `meanwhile()` once both are
    started, then wait for the trainer to finish the run (it must exit 0) and stop the sampler.
    Returns the trainer's log and what `meanwhile` returned."""
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer = worker_process(config_path, "trainer")
    sampler = worker_process(config_path, "sampler", "--id", sampler_id)
    try:
        result = meanwhile()
        _, logs = trainer.communicate(timeout=timeout)
    finally:
        for p in (trainer, sampler):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        sampler.wait(timeout=60)
    assert trainer.returncode == 0, logs[-3000:]
    return logs, result


def eventually(check, timeout: float, every: float = 0.1, why=None):
    """`check()`'s first truthy value, asked every `every` s; past `timeout` s the test fails,
    saying `why(last value)` (else the last value)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, why(value) if why else f"not within {timeout} s: {value!r}"
        time.sleep(every)
    return value


async def eventually_async(check, timeout: float, every: float = 0.05, why=None):
    """eventually, on the test's event loop: `check()`'s first truthy value (awaited where it
    returns an awaitable), asked every `every` s; past `timeout` s, a call that hangs included,
    the test fails, saying `why(last value)` (else the last value)."""
    value, limit = None, asyncio.timeout(timeout)
    try:
        async with limit:
            while not (value := await _answer(check)):
                await asyncio.sleep(every)
    except TimeoutError:
        if not limit.expired():
            raise  # the check's own
        raise AssertionError(why(value) if why else f"not within {timeout} s: {value!r}") from None
    return value


async def _answer(check):
    value = check()
    return await value if inspect.isawaitable(value) else value


def running(*processes: subprocess.Popen) -> None:
    """Each of `processes` still runs; else the test fails with the end of its stderr."""
    for p in processes:
        assert p.poll() is None, p.stderr.read()[-3000:]


def stopped(*processes: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 60) -> None:
    """A test's cleanup, whatever happened before it: each of `processes` still running is sent
    `sig` (SIGKILL; SIGINT or SIGTERM where it must tear down what it started, as `echo-rl up`
    does, or say its last word) and each reaped (a worker left running would load every test
    after this one). One that outlives `timeout` after a gentler signal is killed, and the test
    fails saying so."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(sig)
    hung = []
    for p in processes:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung.append(p.args)
            p.kill()
            p.wait()
    assert not hung, f"still running {timeout} s after signal {sig}: {hung}"


def wait_for_steps(run_dir, steps: int, processes: list[subprocess.Popen], timeout: float = 120) -> None:
    """Until metrics.jsonl has `steps` lines, while every one of `processes` runs."""
    eventually(lambda: len(read_metrics(run_dir)) >= steps or running(*processes), timeout, 0.05,
               why=lambda _: f"fewer than {steps} steps in {timeout} s")


async def _slots_granted(url: str, run_id: str) -> int:
    run = await open_run(url, run_id, "test", create=False)
    try:
        return await slots_granted(run)
    finally:
        await run.close()


async def sampler_statuses(url: str, run_id: str) -> dict:
    """Every sampler's last heartbeat in the run's registry, by sampler id."""
    run = await open_run(url, run_id, "test", create=False)
    try:
        return {s.sampler_id: s for s in await read_statuses(run)}
    finally:
        await run.close()


def wait_until_published(url: str, run_id: str, sampler_id: str, groups: int, process: subprocess.Popen,
                         timeout: float = 120) -> None:
    """Until the sampler's heartbeat says it has published `groups`, while its process runs."""

    def published() -> bool:
        status = asyncio.run(sampler_statuses(url, run_id)).get(sampler_id)
        return (status is not None and status.groups_published >= groups) or running(process)

    eventually(published, timeout, why=lambda _: f"{sampler_id} published fewer than {groups} groups in {timeout} s")


@contextlib.contextmanager
def a_sampler_holding_slots(tmp_path, url: str, steps: int, dead_after_s: float):
    """A trainer (max_staleness 0) and a sampler s2 that pauses 1 s per group after generating it,
    so that it holds its slots for 2 s of each call. Yields (cfg, config_path, processes) once
    s2's first call is in and slots 3 and 4 of step 1 are granted (the trainer records a grant
    before answering it): s2 holds them. On exit, every process of
    `processes` (the test may add its own) still running is resumed and stopped."""
    cfg = tiny_config(tmp_path, run={"steps": steps}, nats={"url": url},
                      trainer={"max_staleness": 0, "sampler_dead_after_s": dead_after_s},
                      sampler={"heartbeat_s": 0.5, "entry_ttl_s": 3})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    processes = [worker_process(config_path, "trainer"),
                 worker_process(config_path, "sampler", "--id", "s2", "--set", "sampler.throttle_s=1.0")]
    try:
        wait_until_published(url, cfg.run.id, "s2", 2, processes[1])
        eventually(lambda: processes[1].poll() is not None or asyncio.run(_slots_granted(url, cfg.run.id)) >= 4, 60,
                   every=0.02, why=lambda _: "s2 was granted no second call")
        running(processes[1])
        yield cfg, config_path, processes
    finally:
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # one stopped (SIGSTOP) hears no SIGTERM
        stop_processes(processes, timeout=60)


def adapter_for_version(engine: HFEngine, version: int) -> list[bytes]:
    """A distinct adapter per version: LoRA B matrices filled with the version number."""
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.fill_(version / 100)
    return list(weights_shards(engine.model, 2**30))


async def store_tampered(weights: WeightsPublisher, version: int, data: bytes, tamper) -> None:
    """Store an adapter, rewrite its chunks in the bucket with `tamper`, then announce the
    original's size and digest, as `weights`' trainer would have."""
    run = weights.run
    name = weights_object_name(weights.term, version, 0)
    await run.weights.put(name, data)
    info = await run.weights.get_info(name)
    subject = f"$O.{run.names.weights_bucket}.C.{info.nuid}"
    sub = await run.js.subscribe(subject, ordered_consumer=True)
    chunks = [(await sub.next_msg(timeout=5)).data for _ in range(info.chunks)]
    await sub.unsubscribe()
    await run.js.purge_stream(f"OBJ_{run.names.weights_bucket}", subject=subject)
    for chunk in tamper(chunks):
        await run.js.publish(subject, chunk)
    shard = WeightsShard(object_name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    announcement = WeightsAnnouncement(
        version=version, term=weights.term, kind="lora", shards=[shard], base_model=TINY_BASE, created_at=0.0
    )
    # The object is announced as it would be by a trainer that computed the digest before damage.
    await run.js.publish(run.names.weights_subject, encode(announcement))


class Relay:
    """`echo-rl relay` as its own process, restartable on the same port and store."""

    def __init__(self, tmp_path, upstream_leaf_url: str, run_id: str, domain: str, upstream_domain: str = "hub",
                 creds: list[str] = ()):
        # A secured relay (`creds`: --creds, --tls-ca) accepts no sub-site relays.
        self.port, self.leaf_port = free_port(), None if creds else free_port()
        self.args = [sys.executable, "-m", "workers.cli", *loopback_relay_args(
            upstream_leaf_url, run_id, self.port, tmp_path / domain, domain, upstream_domain, self.leaf_port), *creds]
        self.log = tmp_path / f"{domain}.stderr"
        self.process: subprocess.Popen | None = None

    url = property(lambda self: f"nats://127.0.0.1:{self.port}")
    leaf_url = property(lambda self: f"nats-leaf://127.0.0.1:{self.leaf_port}")

    def start(self) -> "Relay":
        self.process = subprocess.Popen(self.args, stderr=open(self.log, "ab"))
        return self

    def stop(self) -> None:
        self.process.terminate()
        assert self.process.wait(timeout=20) == 0, self.log.read_text()[-2000:]


@contextlib.contextmanager
def relay(*args, **kwargs):
    r = Relay(*args, **kwargs).start()
    try:
        yield r
    finally:
        if r.process.poll() is None:
            r.stop()


async def collect_and_account(collector: Collector, totals: dict[str, int], need: int):
    """One step's intake as the trainer runs it: collect, checkpoint, ack, count the evicted, then
    account. Returns the new totals and the accounting."""
    async with asyncio.timeout(30):
        collected = await collector.collect(need, version=5)
    collector.trained(collected)  # checkpointed
    return await settle(collector.inbox, collector.consumed, count_consumed(totals, collected))


def assert_accounting_holds(a: dict[str, int]) -> None:
    assert a["trained"] + a["dropped_stale"] + a["rejected"] + a.get("filtered_no_signal", 0) + a.get("evicted", 0) == a["counted"], a
    assert a["published"] == a["counted"] + a["pending"], a


def verl_rows(n: int, answer=lambda i: str(2 * i), ask: bool = True) -> list[dict]:
    """verl's parquet schema: chat messages, reward_model.ground_truth, data_source; `ask`: the
    question asks for a boxed answer (a practitioner's own data often does not)."""
    asked = " Put the answer in \\boxed{}." if ask else ""
    return [{"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"index": i},
             "prompt": [{"role": "user", "content": f"What is {i} + {i}?{asked}"}],
             "reward_model": {"style": "rule", "ground_truth": answer(i)}} for i in range(n)]


@contextlib.contextmanager
def serving(run_dir):
    """`echo-rl status --serve` on a free port; its URL."""
    page = subprocess.Popen([sys.executable, "-m", "workers.cli", "status", "--run", str(run_dir), "--serve", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield page.stdout.readline().split("serving ")[1].split()[0]
    finally:
        page.terminate()
        page.wait(timeout=30)


def next_event(events) -> dict:
    for line in events:
        if line.startswith(b"data: "):
            return orjson.loads(line[len(b"data: "):])
    raise AssertionError("the event stream ended")
