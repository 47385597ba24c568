"""A dataset's training prompts through the broker (echo/tasks/dataset.py): the trainer puts
each shard of prompts and their manifest into the run's weights bucket by digest, and names the
manifest's digest in the run's config; a sampler fetches the shard holding the prompt it drew,
checked against its digest, and keeps the few it read last. No answer is ever published."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from pathlib import Path

import structlog

from echo.tasks import Prompt, Task
from echo.tasks.dataset import PROMPTS_MANIFEST_MAX_BYTES, SHARDS_KEPT, manifest_of, prompt_of
from echo.wire.names import prompts_object_name
from streams.client import BROKER_ERRORS, RunClient
from streams.objects import TransferError, get_object, object_info, put_object, sha256_hex

log = structlog.get_logger()

FETCH_WAIT_S = 60.0  # how long a shard may be missing (a relay still mirroring it) before a call fails
FETCH_RETRY_S = 0.5


async def publish_prompts(run: RunClient, manifest: bytes, shards: list[Path]) -> str:
    """Put the shards, then the manifest, unless already stored; the manifest's SHA-256 (hex)."""
    for data in [*(f.read_bytes() for f in shards), manifest]:
        digest = hashlib.sha256(data).hexdigest()  # the manifest's, last
        name = prompts_object_name(digest)
        stored = await object_info(run.js, run.names.weights_bucket, name)
        if stored is None or sha256_hex(stored) != digest:
            await put_object(run.js, run.names.weights_bucket, name, data)
    log.info("prompts.published", shards=len(shards), manifest=digest)
    return digest


class LocalPrompts:
    """The task's own prompts (generated, or a dataset on this box)."""

    def __init__(self, task: Task):
        self.task = task

    async def prompt(self, index: int) -> Prompt:
        return self.task.prompt(index)


class PromptShards:
    """A dataset's training prompts as published, without their answers."""

    def __init__(self, run: RunClient, manifest_sha256: str):
        self.run, self.manifest_sha256 = run, manifest_sha256
        self.manifest: dict | None = None
        self.shards: OrderedDict[int, list[bytes]] = OrderedDict()

    async def prompt(self, index: int) -> Prompt:
        if self.manifest is None:
            self.manifest = manifest_of(await self._fetch(self.manifest_sha256, max_size=PROMPTS_MANIFEST_MAX_BYTES))
        shard, line = divmod(index % self.manifest["rows"], self.manifest["shard_rows"])
        if shard not in self.shards:
            data = await self._fetch(self.manifest["shards"][shard], size=self.manifest["sizes"][shard])
            self.shards[shard] = bytes(data).splitlines()
            if len(self.shards) > SHARDS_KEPT:
                self.shards.popitem(last=False)
        self.shards.move_to_end(shard)
        return prompt_of(self.shards[shard][line], index)

    async def _fetch(self, sha256: str, size: int | None = None, max_size: int | None = None) -> bytearray:
        """The object, checked against `sha256` and `size` (or at most `max_size` bytes) before
        anything is allocated; missing or failing, tried again for a while."""
        deadline = asyncio.get_running_loop().time() + FETCH_WAIT_S
        while True:
            try:
                return await get_object(self.run.local_js, self.run.names.weights_bucket, prompts_object_name(sha256),
                                        sha256, size, max_size=max_size)
            except (TransferError, *BROKER_ERRORS) as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.debug("prompts.fetch_failed", object=sha256, reason=repr(e))
                await asyncio.sleep(FETCH_RETRY_S)


def prompt_source(run: RunClient, task: Task) -> LocalPrompts | PromptShards:
    """Where a sampler's prompts come from: the broker for a dataset this box does not hold."""
    digest = getattr(task, "remote_prompts", None)
    return PromptShards(run, digest) if digest else LocalPrompts(task)
