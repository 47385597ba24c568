"""The run's config on the wire: one key of the run's state bucket, written by the trainer, so
an edge sampler needs only the server and the run id. What only the trainer's machine can say
(its credential files) stays off the wire; a reader decides what of the rest it accepts
(echo/config/edge.py)."""

from __future__ import annotations

import asyncio

import orjson

from echo.config import EchoConfig
from echo.wire.names import CONFIG_KEY
from streams.client import RunClient
from streams.watch import read_value


async def publish_run_config(run: RunClient, cfg: EchoConfig) -> None:
    await run.state.put(CONFIG_KEY, cfg.model_dump_json(exclude={"nats": {"creds", "tls_ca"}}).encode())


async def run_config(run: RunClient) -> dict | None:
    """The run's config as plain data; None before a trainer wrote it (or unreadable: said and counted)."""
    return (await read_value(run.state, CONFIG_KEY, _json_object))[0]


async def wait_for_run_config(run: RunClient, poll_s: float = 1.0) -> dict:
    """The run's config as plain data, waiting for a trainer that has not started yet."""
    while (config := await run_config(run)) is None:
        await asyncio.sleep(poll_s)  # none yet, or unreadable: the trainer writes it again
    return config


def _json_object(value: bytes) -> dict:
    config = orjson.loads(value)
    if not isinstance(config, dict):
        raise ValueError(f"not a JSON object: {type(config).__name__}")
    return config
