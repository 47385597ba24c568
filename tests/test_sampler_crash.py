"""A sampler process killed in the middle of fetching a version restarts and runs the latest.

The sampler reaches the server through a TCP proxy that stops passing the server's bytes after
half of the new version's size: the fetch is provably in flight when the kill -9 lands."""

import asyncio
import signal
import subprocess
import sys

import orjson
import pytest

from echo.engines.hf import HFEngine
from streams.lease import take_lease
from streams.registry import read_statuses
from streams.weights import WeightsPublisher
from tests.conftest import (
    TINY_BASE,
    a_sampler_holding_slots,
    adapter_for_version,
    eventually_async,
    stopped,
    tiny_config,
    worker_process,
)

pytestmark = pytest.mark.slow


class StallingProxy:
    """Forwards TCP both ways; after `stall_after(n)` it passes n more bytes from the server,
    then holds everything: a link that dies in the middle of a transfer."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self.passed = 0  # bytes server -> client so far
        self.limit: int | None = None
        self.stalled = asyncio.Event()
        self._writers = []

    async def start(self) -> "StallingProxy":
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def stall_after(self, n: int) -> None:
        self.limit = self.passed + n

    async def _on_client(self, client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.server_port)
        self._writers += [client_writer, server_writer]
        await asyncio.gather(self._pipe(client_reader, server_writer, False),
                             self._pipe(server_reader, client_writer, True), return_exceptions=True)

    async def _pipe(self, reader, writer, from_server: bool) -> None:
        while data := await reader.read(65536):
            if from_server and self.limit is not None:
                data = data[: max(0, self.limit - self.passed)]
                if self.passed + len(data) >= self.limit:
                    self.stalled.set()
            if from_server:
                self.passed += len(data)
            writer.write(data)
            await writer.drain()
            if self.stalled.is_set() and from_server:
                await asyncio.Event().wait()  # hold the connection open, pass nothing more

    async def close(self) -> None:
        for w in self._writers:
            w.close()
        self._server.close()


def _sampler(config_path, url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "sampler", "--config", str(config_path), "--id", "k", "--nats", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


async def _until_status(run, predicate, timeout: float = 60.0):
    async def matched():
        statuses = await read_statuses(run)
        return statuses[0] if statuses and predicate(statuses[0]) else None

    return await eventually_async(matched, timeout, every=0.1)


async def test_a_sampler_killed_mid_fetch_restarts_and_loads_the_latest_version(nats_server, runs, tmp_path):
    # LoRA r=256 on every linear layer: a 2 MiB adapter in three 1 MiB chunks, cut halfway.
    cfg = tiny_config(tmp_path, lora={"r": 256, "alpha": 256.0}, sampler={"heartbeat_s": 0.2})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [adapter_for_version(trainer_side, v) for v in range(3)]

    run = await runs.open(cfg.run.id, "trainer")
    weights = WeightsPublisher(await take_lease(run))
    await weights.publish(0, adapters[0], TINY_BASE)
    proxy = await StallingProxy(nats_server.port).start()
    sampler = _sampler(config_path, proxy.url)
    try:
        await _until_status(run, lambda s: s.version == 0)
        proxy.stall_after(len(adapters[1][0]) // 2)
        await weights.publish(1, adapters[1], TINY_BASE)
        await asyncio.wait_for(proxy.stalled.wait(), timeout=30)
        sampler.kill()  # kill -9, half of version 1 received
        sampler.wait()
        [status] = await read_statuses(run)
        assert status.version == 0  # it never got to run version 1
        await proxy.close()

        await weights.publish(2, adapters[2], TINY_BASE)
        sampler = _sampler(config_path, nats_server.url)
        status = await _until_status(run, lambda s: s.version == 2)
        assert status.weight_failures == {}
    finally:
        stopped(sampler)


def test_a_sampler_stopped_while_holding_slots_hands_them_back_at_once(nats_server, tmp_path):
    """SIGTERM abandons the call in flight; the sampler's last heartbeat says `draining`, and the
    trainer hands its slots to another at once, not after sampler_dead_after_s (an hour here)."""
    with a_sampler_holding_slots(tmp_path, nats_server.url, 3, dead_after_s=3600.0) as (cfg, config_path, processes):
        trainer, slow = processes
        slow.send_signal(signal.SIGTERM)  # holding slots 3 and 4 of step 1
        assert slow.wait(timeout=30) == 0
        processes.append(worker_process(config_path, "sampler", "--id", "s1"))
        logs = trainer.communicate(timeout=180)[1]  # s2 is never declared dead (an hour): released as stopped
        assert trainer.returncode == 0, logs[-3000:]
        assert '"grants.undelivered"' not in logs  # a stop costs its call's slots: within the bound
    released = [orjson.loads(line) for line in logs.splitlines() if '"grants.slots_released"' in line]
    assert [(r["sampler"], r["stopped"], r["slots"]) for r in released] == [("s2", True, 2)], released
    # What the operator reads meanwhile: s2 gone, no sampler left, then s1 joining.
    said = [orjson.loads(line)["event"] for line in logs.splitlines() if '"trainer.s' in line or "no_samplers" in line]
    assert said[said.index("trainer.sampler_gone"):][:3] == ["trainer.sampler_gone", "trainer.no_samplers",
                                                             "trainer.sampler_joined"], said


def test_a_sampler_killed_and_restarted_under_its_id_at_once_gets_its_predecessors_slots_handed_out(
        nats_server, tmp_path):
    """A sampler restarted under its id: slots are held by sampler id, and a replacement that heartbeats within
    `sampler_dead_after_s` (as systemd, compose or Kubernetes restart a process) hid the death:
    the slots came back only after `trainer.reissue_after_s` (300 s; at S = 0 no step till then).
    Each process now names itself (a random `process` name) in its heartbeats and requests: the new one
    is told from the old at its first, and the old one's slots are handed out at once (at
    S >= 1 they shrank the window instead: test_grants)."""
    with a_sampler_holding_slots(tmp_path, nats_server.url, 3, dead_after_s=3600.0) as (cfg, config_path, processes):
        trainer, killed = processes
        killed.kill()  # kill -9, holding slots 3 and 4 of step 1
        killed.wait()
        processes.append(worker_process(config_path, "sampler", "--id", "s2"))  # the restart policy's
        logs = trainer.communicate(timeout=180)[1]  # the dead one is never declared dead (an hour)
        assert trainer.returncode == 0, logs[-3000:]
        assert '"grants.undelivered"' not in logs
    released = [orjson.loads(line) for line in logs.splitlines() if '"grants.slots_released"' in line]
    assert released and released[0]["sampler"] == "s2" and released[0]["restarted"], released
    rejoined = [orjson.loads(line) for line in logs.splitlines() if '"trainer.sampler_rejoined"' in line]
    assert [(r["sampler"], r["restarted"]) for r in rejoined] == [("s2", True)], rejoined
