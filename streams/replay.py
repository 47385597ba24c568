"""Replay a run's rollout stream, for debugging: every stored group in order, with its headers.

Given a run directory, it starts a server on the run's own JetStream store, so a finished run
can be inspected after the fact; given --nats, it reads a live server."""

from __future__ import annotations

import asyncio
import sys
import tomllib
from pathlib import Path
from typing import AsyncIterator

import orjson
from nats.js.api import DeliverPolicy

from echo.protocol import ProtocolError, RunNames, decode_rollout
from streams.client import connect
from streams.rollouts import rollout_body
from streams.server import NatsServer


async def read_rollouts(url: str, run_id: str) -> AsyncIterator[dict]:
    """Each stored rollout message as {seq, subject, headers, group | error}, oldest first."""
    names = RunNames(run_id)
    nc = await connect(url, "replay")
    try:
        js = nc.jetstream()
        info = await js.stream_info(names.rollouts_stream)
        if info.state.messages == 0:
            return
        sub = await js.subscribe(names.all_rollouts, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        while True:
            msg = await sub.next_msg(timeout=10)
            record = {"seq": msg.metadata.sequence.stream, "subject": msg.subject, "headers": msg.headers}
            try:
                data = await rollout_body(js, names, msg)
                record["group"] = decode_rollout(data, msg.headers, msg.subject).model_dump()
            except ProtocolError as e:
                record["error"] = str(e)
            yield record
            if msg.metadata.num_pending == 0:
                break
        await sub.unsubscribe()
    finally:
        await nc.close()


async def _dump(url: str, run_id: str, out) -> int:
    count = 0
    async for record in read_rollouts(url, run_id):
        out.write(orjson.dumps(record).decode() + "\n")
        count += 1
    return count


def replay(run: str, nats_url: str | None, out_path: str | None) -> int:
    out = open(out_path, "w") if out_path else sys.stdout
    try:
        if nats_url:
            asyncio.run(_dump(nats_url, run, out))
            return 0
        run_dir = Path(run)
        run_id = tomllib.loads((run_dir / "config.toml").read_text())["run"]["id"]
        with NatsServer(run_dir / "nats") as server:
            asyncio.run(_dump(server.url, run_id, out))
        return 0
    finally:
        if out_path:
            out.close()
