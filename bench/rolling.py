"""Benchmark: planned maintenance of a 3-node JetStream cluster under load (issue 83). Rollouts
are published and the run's state bucket written without a pause while each node in turn is
stopped and started again, its replicas let catch up before the next: gracefully (SIGTERM, as
`systemctl stop` or `docker stop` do) every node, then one node killed (SIGKILL) for comparison.
Recorded per restart: the longest wait of a rollout's publish and of a KV write, and at the end
whether every acknowledged rollout is in the stream once.

    .venv/bin/python -m bench.rolling

Writes bench/results/rolling-restart.json (with the machine's load).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from bench.common import write_results
from bench.transport import make_group
from echo.wire.names import Storage
from streams.client import RunClient, open_run, retry_forever
from streams.rollouts import publish_rollout
from streams.server import NatsCluster, replicas_current

CATCH_UP_S = 120.0  # a guard: a node started again catches up in seconds


class Writers:
    """Rollouts published and a KV key written, each without a pause, till `stop`; `longest`:
    each one's longest wait since `mark()`."""

    def __init__(self, run: RunClient):
        self.run, self.acked, self.longest = run, [], {"publish": 0.0, "put": 0.0}
        self.stopping = asyncio.Event()
        self.tasks = [asyncio.create_task(self._without_pause("publish", self._publish)),
                      asyncio.create_task(self._without_pause("put", self._put))]

    def mark(self) -> dict[str, float]:
        """The longest waits since the last mark, and a new count from now."""
        said, self.longest = self.longest, dict.fromkeys(self.longest, 0.0)
        return {k: round(v, 2) for k, v in said.items()}

    async def _without_pause(self, what: str, write) -> None:
        last = time.monotonic()
        while not self.stopping.is_set():
            await retry_forever(what, write)  # publish_rollout retries by itself; a KV write is retried here
            now = time.monotonic()
            self.longest[what], last = max(self.longest[what], now - last), now

    async def _publish(self) -> None:
        group = make_group(2, 8, len(self.acked))  # small: many writes, each a chance to meet the restart
        await publish_rollout(self.run, group)
        self.acked.append(group.group_id)

    async def _put(self) -> None:
        await self.run.state.put("maintenance", b"x" * 64)

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)

    async def all_there(self) -> bool:
        """Every acknowledged rollout in the stream, once."""
        messages = (await self.run.js.stream_info(self.run.names.rollouts_stream)).state.messages
        return messages == len(self.acked) == len(set(self.acked))


def run_streams(run: RunClient) -> list[str]:
    names = run.names
    return [names.rollouts_stream, names.control_stream, f"KV_{names.state_bucket}", f"OBJ_{names.weights_bucket}"]


async def restart(cluster: NatsCluster, run: RunClient, i: int, graceful: bool = True) -> float:
    """Node i stopped and started again; the seconds until every replica of the run is current."""
    began = time.monotonic()
    await asyncio.to_thread(cluster.restart, i, graceful)
    async with asyncio.timeout(CATCH_UP_S):
        while not await retry_forever("stream info", lambda: replicas_current(run.js, run_streams(run))):
            await asyncio.sleep(0.2)
    return round(time.monotonic() - began, 2)


async def measure() -> dict:
    with tempfile.TemporaryDirectory() as folder, NatsCluster(Path(folder) / "nats", 3, log_dir=folder) as cluster:
        run = await open_run(cluster.url, "rolling", "bench", storage=Storage(replicas=3), mirror_wait_s=60)
        writers = Writers(run)
        try:
            await asyncio.sleep(2.0)
            steady = writers.mark()
            restarts = []
            for i, graceful in [(0, True), (1, True), (2, True), (0, False)]:
                back_s = await restart(cluster, run, i, graceful)
                await asyncio.sleep(2.0)  # the writes after it too
                restarts.append({"node": f"n{i}", "stop": "SIGTERM" if graceful else "SIGKILL", "back_s": back_s,
                                 "longest_wait_s": writers.mark()})
        finally:
            await writers.stop()
        result = {"steady_longest_wait_s": steady, "restarts": restarts, "published": len(writers.acked),
                  "nothing_lost_nor_twice": await writers.all_there()}
        await run.close()
        return result


def main() -> None:
    out = write_results("rolling-restart.json", asyncio.run(measure()))
    print(out.read_text())


if __name__ == "__main__":
    main()
