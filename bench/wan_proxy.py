"""A wide-area link in userspace: a TCP proxy that delays and rate-limits what it forwards.

This machine has no netem (the kernel lacks the qdisc), so the link is simulated here: every
byte forwarded in a direction waits for the link to be free (one shared link per direction,
whatever the number of connections through it, as a site's uplink is shared), takes
len / bandwidth to cross it, then arrives half a round trip later. Order is kept per connection.

    async with WanProxy(("127.0.0.1", hub_port), rtt_s=0.05, mbit=100) as proxy:
        ...  # connect to ("127.0.0.1", proxy.port) instead of the hub
"""

from __future__ import annotations

import asyncio
import time

CHUNK = 64 * 1024


class Link:
    """One direction of the link: when each chunk has crossed it."""

    def __init__(self, bytes_per_s: float, one_way_s: float):
        self.bytes_per_s, self.one_way_s, self.free_at = bytes_per_s, one_way_s, 0.0
        self.bytes = 0

    def arrival(self, size: int) -> float:
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + size / self.bytes_per_s
        self.bytes += size
        return self.free_at + self.one_way_s


class WanProxy:
    def __init__(self, target: tuple[str, int], rtt_s: float, mbit: float, port: int = 0):
        self.target = target
        self.up = Link(mbit * 1e6 / 8, rtt_s / 2)  # towards the target (e.g. a site's uplink to the hub)
        self.down = Link(mbit * 1e6 / 8, rtt_s / 2)  # from the target
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> WanProxy:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _connect(self, client_reader, client_writer) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        for reader, writer, link in ((client_reader, target_writer, self.up), (target_reader, client_writer, self.down)):
            task = asyncio.create_task(_pump(reader, writer, link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Read as fast as the sender sends; deliver each chunk at its arrival time, in order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while (item := await queue.get()) is not None:
            arrival, data = item
            await asyncio.sleep(max(0.0, arrival - time.monotonic()))
            writer.write(data)
            await writer.drain()
        writer.close()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((link.arrival(len(data)), data))
        queue.put_nowait(None)
        await delivering
        return
    except ConnectionError:  # one side went away: so does the other
        pass
    finally:
        delivering.cancel()
        writer.close()


async def serve(port: int, target: tuple[str, int], rtt_s: float, mbit: float) -> None:
    async with WanProxy(target, rtt_s, mbit, port):
        await asyncio.Event().wait()  # until killed


def main() -> None:
    """`python -m bench.wan_proxy PORT HOST:PORT RTT_MS MBIT`: a link in its own process, so
    the benchmark's own work does not delay what crosses it."""
    import sys

    port, target, rtt_ms, mbit = sys.argv[1:5]
    host, target_port = target.rsplit(":", 1)
    asyncio.run(serve(int(port), (host, int(target_port)), float(rtt_ms) / 1000, float(mbit)))


if __name__ == "__main__":
    main()
