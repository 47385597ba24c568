"""The run's config on the wire: one key of the run's state bucket, written by the trainer, so
an edge sampler needs only the server and the run id. What only the trainer's machine can say
(its credential files) stays off the wire; a reader decides what of the rest it accepts
(echo/edge.py)."""

from __future__ import annotations

import asyncio

import orjson
from nats.js.errors import KeyNotFoundError

from echo.config import EchoConfig
from echo.protocol import CONFIG_KEY
from streams.client import Run


async def publish_run_config(run: Run, cfg: EchoConfig) -> None:
    await run.state.put(CONFIG_KEY, cfg.model_dump_json(exclude={"nats": {"creds", "tls_ca"}}).encode())


async def wait_for_run_config(run: Run, poll_s: float = 1.0) -> dict:
    """The run's config as plain data, waiting for a trainer that has not started yet."""
    while True:
        try:
            return orjson.loads((await run.state.get(CONFIG_KEY)).value)
        except KeyNotFoundError:
            await asyncio.sleep(poll_s)
