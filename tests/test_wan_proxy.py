"""The benchmarks' WAN link (bench/wan_proxy.py): what crosses it arrives intact and in order,
no sooner than the round trip allows, and no faster than the bandwidth, which connections
share. Only lower bounds are checked: a slow machine can only make the link slower."""

import asyncio
import os
import time

from bench.wan_proxy import WanProxy


async def _echo(reader, writer):
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(port: int, payload: bytes) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    echoed = await reader.readexactly(len(payload))
    seconds = time.monotonic() - started
    assert echoed == payload  # intact, in order
    writer.close()
    return seconds


async def test_the_link_delays_and_rate_limits_and_its_bandwidth_is_shared():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[:2]
    async with WanProxy(target, rtt_s=0.2, mbit=8) as link:  # 1 MB/s each way
        assert await _round_trip(link.port, b"ping") >= 0.2  # one round trip
        # 300 kB out and back: 0.3 s on each direction's wire, plus the round trip.
        assert await _round_trip(link.port, os.urandom(300_000)) >= 0.2 + 0.3
        # Two connections at once share the wire: 2 x 200 kB take as long as 400 kB.
        started = time.monotonic()
        await asyncio.gather(*(_round_trip(link.port, os.urandom(200_000)) for _ in range(2)))
        assert time.monotonic() - started >= 0.2 + 0.4
        assert link.up.bytes == link.down.bytes == 4 + 300_000 + 400_000
    server.close()
