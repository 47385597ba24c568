"""Faults that must never wedge a run or fail silently: supervised background tasks,
workers that stop on SIGTERM, weights fetches that fail and recover."""

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats.errors
import orjson
import pytest
import structlog.testing
import torch

from echo.config import ConfigError
from echo.engines.hf import HFEngine
from echo.fleet.grants import GrantLedger
from echo.model.loading import load_model
from echo.model.policy import make_policy
from echo.process.lifeline import exited, process_name
from echo.tasks import load_task
from echo.train.checkpoint import TrainerState
from echo.train.learner import Batch, Forward, Rewarded, StepAbandoned, make_optimizer, train_step
from echo.train.metrics import read_metrics
from echo.trust.scorer import Scorer
from echo.wire.codec import encode
from echo.wire.messages import WeightsAnnouncement
from echo.wire.names import TRAINER_KEY, Storage, weights_object_name
from streams.client import retry_forever
from streams.inbox import RolloutInbox
from streams.lease import HELD_S, RENEW_S, AnotherTrainer, take_lease
from streams.objects import put_object
from streams.registry import put_status, read_statuses
from streams.rollouts import publish_rollout
from streams.server import PORTS_ENV, NatsServer, ServerConfig, free_port
from streams.watch import LatestValue
from streams.weights import WeightsPublisher
from tests.conftest import (
    TINY_BASE,
    adapter_for_version,
    alive,
    assert_accounting_holds,
    collect_and_account,
    eventually,
    eventually_async,
    stopped,
    store_tampered,
    tiny_config,
    wait_for_steps,
    worker_process,
)
from tests.groups import SCORER, granted, honest_group
from workers.sampler.sampler import Sampler
from workers.trainer.accounting import count_consumed, settle
from workers.trainer.granter import SequentialGranter
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline


async def test_a_sampler_retries_a_heartbeat_the_broker_missed_and_stops_on_any_other_error(
        runs, tmp_path, monkeypatch):
    """A missed beat (the broker restarting) is tried again; an error in our own code ends the
    sampler with that error (its process exits non-zero and is restarted) instead of leaving a
    generation loop running without a heartbeat."""
    cfg = tiny_config(tmp_path, sampler={"heartbeat_s": 0.05})
    beats = []

    async def put_with_faults(run, status):
        beats.append(status.updated_at)
        if len(beats) == 1:
            raise nats.errors.TimeoutError  # the broker: tried again
        if len(beats) == 3:
            raise ValueError("a bug in the heartbeat")
        await put_status(run, status)

    run = await runs.open(cfg.run.id, "sampler")
    monkeypatch.setattr("workers.sampler.heartbeat.put_status", put_with_faults)
    sampler = Sampler(cfg, "s1", run, HFEngine("tiny", cfg.lora, cfg.sampling), task=None)  # it waits for weights: none come
    with pytest.raises(ValueError, match="a bug in the heartbeat"):
        await asyncio.wait_for(sampler.serve(), 10)
    assert len(beats) == 4  # the failed first, a good one, the bug, the last word on the way out
    assert [s.sampler_id for s in await read_statuses(run)] == ["s1"]


def _stop(process: subprocess.Popen) -> str:
    """SIGTERM, then what it logged before it exited (a minute at most: the run had hours left)."""
    process.send_signal(signal.SIGTERM)
    return process.communicate(timeout=60)[1]


@pytest.mark.slow
def test_trainer_and_sampler_stop_on_sigterm_mid_run_the_trainer_within_its_step(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, run={"id": "term", "steps": 1000}, nats={"url": nats_server.url})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    sampler = worker_process(config_path, "sampler", "--id", "s1")
    trainer = worker_process(config_path, "trainer")
    try:
        wait_for_steps(cfg.run_dir, 2, [trainer, sampler])
        steps_at_sigterm = len(read_metrics(cfg.run_dir))
        trainer_logs = _stop(trainer)
        sampler_logs = _stop(sampler)
    finally:
        stopped(trainer, sampler)
    assert trainer.returncode == 0, trainer_logs[-2000:]
    assert len(read_metrics(cfg.run_dir)) <= steps_at_sigterm + 1  # it stops in the step it is in, however slow
    assert sampler.returncode == 0, sampler_logs[-2000:]
    events = [orjson.loads(line)["event"] for line in sampler_logs.splitlines() if line.startswith("{")]
    assert "sampler.stopped" in events


class StopAtCheck(threading.Event):
    """Set from the n-th time the step looks: as if SIGTERM arrived mid-step."""

    def __init__(self, n: int):
        super().__init__()
        self.looks, self.n = 0, n

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_a_step_told_to_stop_is_abandoned_between_passes_and_leaves_the_policy_as_it_was(tmp_path):
    cfg = tiny_config(tmp_path, trainer={"micro_batch_tokens": 0})  # a group a pass: three passes
    base, tokenizer = load_model("tiny")
    policy = make_policy(base, cfg.lora)
    with torch.no_grad():  # a non-zero adapter, so an update shows in every tensor
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    optimizer = make_optimizer(policy, cfg)
    groups = [honest_group(12 + i) for i in range(3)]
    batch = Batch([Rewarded(g, [float(i % 2) for i in range(len(g.completions))]) for g in groups])
    before = [p.detach().clone() for p in policy.parameters() if p.requires_grad]

    def unchanged() -> bool:
        return all(torch.equal(a, p) for a, p in zip(before, (p for p in policy.parameters() if p.requires_grad)))

    with pytest.raises(StepAbandoned, match="1 of 3 passes done"):
        train_step(Forward.of(policy, cfg, tokenizer.pad_token_id), optimizer, batch, StopAtCheck(2))
    assert unchanged() and all(p.grad is None for p in policy.parameters())
    forward = Forward.of(policy, cfg, tokenizer.pad_token_id)
    train_step(forward, optimizer, batch, threading.Event())  # not stopped: it steps
    assert not unchanged()


async def _ask_for_version(lease, cfg, version: int) -> SequentialGranter:
    """A sequential trainer's orders, asking for `version`'s groups."""
    orders = SequentialGranter(lease.run, lease.term, cfg, TrainerState(version=version), GrantLedger())
    await orders.start()
    await orders.ask(version)
    return orders


async def _serving_sampler(runs, cfg) -> tuple:
    """Sampler s1 on its own connection (a run of the `runs` fixture), serving: (its run, the
    sampler, its task)."""
    sampler_run = await runs.open(cfg.run.id, "sampler", create=False)
    sampler = Sampler(cfg, "s1", sampler_run, HFEngine("tiny", cfg.lora, cfg.sampling), load_task(cfg.task))
    return sampler_run, sampler, asyncio.create_task(sampler.serve())


async def _collect_step(lease, cfg, version: int, ledger: GrantLedger):
    """A trainer's collector for `version` (its granter's `ledger`), and the step's groups it collected."""
    run = lease.run
    base, tokenizer = load_model("tiny")
    scorer = Scorer(load_task(cfg.task), tokenizer, base.get_input_embeddings().num_embeddings, cfg.sampling)
    collector = Collector(await RolloutInbox.open(run), Judge(scorer, Timeline(max_staleness=0, term=lease.term)), ledger)
    async with asyncio.timeout(30):
        return collector, await collector.collect(cfg.trainer.groups_per_step, version=version)


async def test_a_sequential_sampler_whose_fetch_of_the_requested_version_fails_recovers(runs, tmp_path):
    """Sequential mode waits for exactly the requested version. Its object arrives damaged
    (refused), is stored again whole, and the sampler, retrying while the version is the
    newest, applies it and generates the request's groups: no deadlock. Before, it waited for a
    newer version that the trainer, waiting for these groups, would never publish."""
    cfg = tiny_config(tmp_path, run={"mode": "sequential"})
    adapter = adapter_for_version(HFEngine("tiny", cfg.lora, cfg.sampling), 0)[0]

    run = await runs.open(cfg.run.id, "trainer")
    weights = WeightsPublisher(lease := await take_lease(run))
    await store_tampered(weights, 0, adapter, lambda chunks: [chunks[0][:-1] + b"!", *chunks[1:]])
    orders = await _ask_for_version(lease, cfg, 0)
    _, sampler, serving = await _serving_sampler(runs, cfg)
    await eventually_async(lambda: sampler.weights.follower.failures, 10)
    assert set(sampler.weights.follower.failures) == {"digest_mismatch"} and sampler.weights.version == -1
    await put_object(run.js, run.names.weights_bucket, weights_object_name(lease.term, 0, 0), adapter)  # whole again
    collector, collected = await _collect_step(lease, cfg, 0, orders.ledger)
    assert len(collected.used) == cfg.trainer.groups_per_step and sampler.weights.version == 0
    collector.consumed.add(collected.seqs)  # the step checkpointed: every message is accounted for
    _, a = await settle(collector.inbox, collector.consumed, count_consumed({}, collected))
    assert a["trained"] + a["dropped_stale"] + a["rejected"] == a["counted"] and a["unconfirmed_acks"] == a["evicted"] == 0
    assert a["published"] == a["counted"] + a["pending"], a
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await orders.subscription.unsubscribe()


async def test_a_sequential_sampler_asked_for_an_older_version_of_a_new_term_waits_for_it(runs, tmp_path):
    """A trainer resumed from an older checkpoint asks for version 0 of its term 2 while the
    samplers run version 1 of term 1, and its request can arrive before its weights (a relay's
    mirror lags the hub). Before, the sampler took version 1 for 'version 0 or newer', skipped
    the request and waited for the next one, which never came: the run stalled."""
    cfg = tiny_config(tmp_path, run={"mode": "sequential"})
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [adapter_for_version(trainer_side, v) for v in (0, 1)]

    run = await runs.open(cfg.run.id, "trainer")
    lease = await take_lease(run)
    weights = WeightsPublisher(lease)
    for version, adapter in enumerate(adapters):
        await weights.publish(version, adapter, TINY_BASE)
    orders = await _ask_for_version(lease, cfg, 1)
    _, sampler, serving = await _serving_sampler(runs, cfg)
    await eventually_async(lambda: sampler.generation.published >= cfg.trainer.groups_per_step, 30)
    assert sampler.weights.running == (1, 1)
    await orders.subscription.unsubscribe()
    await lease.release()
    lease = await take_lease(run)  # term 2, resumed at version 0
    weights = WeightsPublisher(lease)  # a publisher is its lease's: term 2's versions
    orders = await _ask_for_version(lease, cfg, 0)
    # The sampler has the request, and no weights of term 2 yet.
    await eventually_async(lambda: (sampler.work.pull_request.term, sampler.work.pull_request.version) == (2, 0), 30)
    await weights.publish(0, adapters[0], TINY_BASE)
    _, collected = await _collect_step(lease, cfg, 0, orders.ledger)
    assert {(a.group.term, a.group.version) for a in collected.used} == {(2, 0)}
    serving.cancel()
    await orders.subscription.unsubscribe()


async def test_a_sequential_sampler_whose_request_for_work_goes_unanswered_asks_again(runs, tmp_path):
    """No answer to a request for work (the trainer not serving grants yet, a broker restarting)
    is not "all given out". Before, a sequential sampler took it so and waited for the next pull
    request, which a trainer waiting for this one's groups never publishes: the run stalled."""
    cfg = tiny_config(tmp_path, run={"mode": "sequential"})
    adapter = adapter_for_version(HFEngine("tiny", cfg.lora, cfg.sampling), 0)

    run = await runs.open(cfg.run.id, "trainer")
    lease = await take_lease(run)
    await WeightsPublisher(lease).publish(0, adapter, TINY_BASE)
    orders = SequentialGranter(run, lease.term, cfg, TrainerState(), GrantLedger())
    await orders.ask(0)  # the request is out; no one answers requests for work yet
    _, sampler, serving = await _serving_sampler(runs, cfg)
    await eventually_async(lambda: sampler.weights.running == (1, 0), 30)  # it has the request's weights, and is asking
    await eventually_async(lambda: sampler.work.unanswered, 30)  # asked, and not answered
    await orders.start()  # now the trainer answers
    _, collected = await _collect_step(lease, cfg, 0, orders.ledger)
    assert len(collected.used) == cfg.trainer.groups_per_step
    serving.cancel()
    await orders.subscription.unsubscribe()


async def test_a_sampler_that_starts_following_weights_while_the_broker_is_down_waits_for_it(nats_server, runs):
    """Seen in the broker-restart chaos test: a sampler still starting when the broker was
    killed failed its first subscription (a timeout) and exited. The follower reads by polling,
    and a read the broker fails is tried again: it hears of the version once the broker is back."""

    run = await runs.open("late", "trainer")
    weights = WeightsPublisher(await take_lease(run))
    announcements = LatestValue(run.js, run.names.control_stream, run.names.weights_subject, WeightsAnnouncement,
                                lambda error: None)
    nats_server.process.send_signal(signal.SIGKILL)
    nats_server.process.wait()
    with structlog.testing.capture_logs() as logs:
        await announcements.start()
        # A read the broker failed.
        await eventually_async(lambda: any(e["event"] == "follow.read_failed" for e in logs), 60)
    assert announcements.seq == 0
    await asyncio.to_thread(nats_server.start)
    async with asyncio.timeout(30):
        published = await retry_forever("publish", lambda: weights.publish(0, [b"v0"], TINY_BASE))
        assert (await announcements.wait_newer(0))[1] == published
    await announcements.stop()


LEASE_HOLDER = """
import asyncio, sys
from streams.client import open_run
from streams.lease import take_lease

async def main(url):
    lease = await take_lease(await open_run(url, "restart", "trainer-1"))
    print("held", flush=True)
    await lease.renew_forever()

asyncio.run(main(sys.argv[1]))
"""


async def test_a_trainer_restarted_on_its_machine_takes_the_run_at_once_and_a_live_one_is_still_waited_for(
        nats_server, runs):
    """A trainer restarted on its machine: it waited out its dead predecessor's lease (4.2 s of its 10.4 s
    to a first step) even on the machine where it could see that process had exited. It now takes
    the run at once there (a zombie not yet reaped has exited too); a live holder, or one it
    cannot see, is watched for the lapse as before."""
    run = await runs.open("restart", "trainer-2")
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, nats_server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AnotherTrainer, match="live trainer"):  # renewing, though on this machine
            await take_lease(run)
        holder.send_signal(signal.SIGKILL)
        # Dead: a zombie, not reaped (this test does not wait for it).
        await eventually_async(lambda: not alive(holder.pid), 30)
        async with asyncio.timeout(30):
            taken = await take_lease(run, lapse_s=3600)  # not waited for
    finally:
        stopped(holder)
    assert taken.term == 2 and taken.lease.process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are named from Linux's /proc")
def test_a_process_is_told_exited_only_where_its_machine_and_pid_namespace_are_this_ones():
    me = process_name()
    assert me and not exited(me)
    boot, namespace, pid, started = me.split("/")
    assert exited(f"{boot}/{namespace}/{pid}/{int(started) - 1}")  # this pid, an earlier process's
    assert not exited(f"another-boot/{namespace}/{pid}/{int(started) - 1}")  # another machine: cannot tell
    assert not exited(f"{boot}/1/{pid}/{int(started) - 1}")  # another pid namespace (a container)
    assert not exited("") and not exited("x")


async def test_a_trainer_keeps_its_lease_when_a_renewal_it_gave_up_on_was_applied(runs):
    """Seen with the broker down 12 s: a renewal timed out here, nats-py sent it once the broker
    was back, and the next renewal's compare-and-set failed; the trainer took that for another
    trainer and stopped. The key holding this lease still is not a takeover; a later term is."""

    run = await runs.open("renew", "trainer")
    lease = await take_lease(run)
    renewing = asyncio.create_task(lease.renew_forever())
    await run.state.put(TRAINER_KEY, encode(lease.lease))  # the renewal given up on, applied
    moved_to = (await run.state.get(TRAINER_KEY)).revision
    # Renewed past it, or fenced out.
    await eventually_async(lambda: lease.revision > moved_to or renewing.done(), 10 * RENEW_S)
    assert lease.lost is None and not renewing.done()
    await run.state.put(TRAINER_KEY, encode(lease.lease.model_copy(update={"term": lease.term + 1})))
    async with asyncio.timeout(5 * RENEW_S):
        with pytest.raises(AnotherTrainer):  # fenced out: it stops at once
            await renewing
    assert isinstance(lease.lost, AnotherTrainer)


async def test_a_trainer_whose_renewals_fail_acts_on_the_run_only_once_it_renewed(nats_server, runs):
    """A lease not confirmed: killing the trainer's cluster node failed its lease renewals for ~4 s while it
    went on checkpointing and announcing, the time after which a standby may take over. A trainer
    now acts only within HELD_S of its last confirmed renewal, and waits meanwhile."""
    run = await runs.open("held", "trainer")
    lease = await take_lease(run)
    renewing = asyncio.create_task(lease.renew_forever())
    try:
        await asyncio.wait_for(lease.held(), 1.0)  # renewing: held at once
        nats_server.process.send_signal(signal.SIGSTOP)  # no renewal is confirmed
        try:
            stopped = time.monotonic()
            await asyncio.sleep(HELD_S)  # what it renewed before the stop was sent before it
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(lease.held(), 2 * RENEW_S)
            assert lease.renewed_at < stopped
        finally:
            nats_server.process.send_signal(signal.SIGCONT)
        async with asyncio.timeout(30):
            await lease.held()  # renewed again: it goes on
        assert lease.renewed_at > stopped and lease.lost is None
    finally:
        renewing.cancel()


BUSY_WORKER = """
import asyncio, sys
import nats
from workers.arguments import run_until_signal

async def worker(url):
    nc = await nats.connect(url)
    for i in range(200_000):  # fills nats-py's flush queue: its publish then waits inside its flush
        await nc.publish("busy", b"x" * 100)
        if i == 1000:  # well into the loop, with most of it to go: the signal lands inside it
            print("publishing", flush=True)
    await asyncio.Event().wait()

sys.exit(run_until_signal(worker(sys.argv[1])))
"""


def test_sigterm_stops_a_worker_even_when_nats_py_swallows_the_cancellation(nats_server):
    """Seen as a relay that never stopped: a SIGTERM whose cancellation lands inside a nats-py
    call is swallowed there (Client._flush_pending catches CancelledError), and the worker ran on.
    The signal's cancellation is repeated until the worker has ended."""
    worker = subprocess.Popen([sys.executable, "-c", BUSY_WORKER, nats_server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "publishing"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=15) == 0
    finally:
        stopped(worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_an_embedded_server_dies_with_the_process_that_started_it_and_a_held_port_is_named(tmp_path):
    """A relay's nats-server runs in a session of its own and outlived a kill -9 of the relay; on
    restart the new server exited with "address already in use", yet the relay logged
    relay.ready: NatsServer.start() only checked that something listened on the port. Now the
    server gets SIGTERM when its starter dies, and a port held by another process is an error
    naming it."""
    script = ("import sys, time; from streams.server import NatsServer; "
              f"s = NatsServer({str(tmp_path / 'store')!r}).start(); print(s.port, s.process.pid, flush=True); "
              "time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parent.parent)
    port, pid = map(int, starter.stdout.readline().split())
    with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is held by pid {pid} "):
        NatsServer(tmp_path / "second", ServerConfig(port=port)).start()
    starter.kill()
    starter.wait()
    eventually(lambda: not alive(pid), 30, why=lambda _: f"the server (pid {pid}) outlived its starter")
    NatsServer(tmp_path / "second", ServerConfig(port=port)).start().stop()  # the port is free again


def test_servers_listen_outside_the_ports_outgoing_connections_take():
    """A broker restarted on its port (the chaos tests, a relay) needs the port still free, and a
    server started on a port just picked needs it free until it binds. A port from the kernel's
    ephemeral range can be taken meanwhile by any outgoing connection: picks stay below it."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ephemeral.exists():
        pytest.skip("Linux's ephemeral port range")
    low, high = map(int, ephemeral.read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)  # a server and its leaf port never share one
    assert not any(low <= port <= high for port in ports)


def test_servers_listen_in_the_ports_echo_listen_ports_names(monkeypatch):
    """A firewall's opening (or, under `make test`, each test process's own slice): every pick in
    it, none twice, and a range that is not one is said naming the variable."""
    monkeypatch.setenv(PORTS_ENV, "40000-40009")  # outside any test process's slice: none picked before
    ports = []
    with pytest.raises(RuntimeError, match="no free port in 40000-40009"):
        while len(ports) <= 10:
            ports.append(free_port())
    assert ports and len(set(ports)) == len(ports) and set(ports) <= set(range(40000, 40010))
    for wrong in ("29999-29990", "80-90", "29990", "a-b"):
        monkeypatch.setenv(PORTS_ENV, wrong)
        with pytest.raises(ConfigError, match=f"{PORTS_ENV}='{wrong}': FIRST-LAST"):
            free_port()


async def test_messages_the_stream_evicted_before_the_trainer_read_them_are_named_in_the_accounting(runs):
    """With `nats.rollouts_max_gb` set, the stream evicts its oldest messages, read or not: 1239
    published against 1145 counted, and the accounting identity no longer held. Those the trainer
    never read are now counted as `evicted`."""
    run = await runs.open("evict", "trainer", storage=Storage(rollouts_max_bytes=12_000))
    ledger = GrantLedger()
    collector = Collector(await RolloutInbox.open(run), Judge(SCORER, Timeline(max_staleness=1)), ledger)
    for i in range(2):
        await publish_rollout(run, granted(ledger, honest_group(30 + i, version=5, group_id=f"early{i}")))
    totals, first = await collect_and_account(collector, {}, 2)
    for i in range(40):  # more than the stream keeps: the oldest unread ones go
        await publish_rollout(run, granted(ledger, honest_group(40 + i, version=5, group_id=f"late{i}")))
    totals, later = await collect_and_account(collector, totals, 2)
    for a in (first, later):
        assert_accounting_holds(a)
    assert later["evicted"] > 0 and later["published"] == 42, later
