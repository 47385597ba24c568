"""Sequential mode on the wire: the trainer publishes a pull request (version, number of groups)
on the pull subject; samplers claim its work slots one by one with a KV create, so a fast
sampler takes more slots than a slow one and no slot is generated twice."""

from __future__ import annotations

import uuid

from nats.js.errors import KeyWrongLastSequenceError

from echo.protocol import PullRequest, claim_key, encode
from streams.client import Run, publish_once


async def publish_pull_request(run: Run, version: int, groups: int) -> PullRequest:
    request = PullRequest(request_id=uuid.uuid4().hex, version=version, groups=groups)
    await publish_once(run, run.names.pull_subject, encode(request))
    return request


async def claim_slot(run: Run, request: PullRequest, slot: int, sampler_id: str) -> bool:
    """True if this sampler now owns the slot; False if another sampler took it first."""
    try:
        await run.claims.create(claim_key(request.request_id, slot), sampler_id.encode())
        return True
    except KeyWrongLastSequenceError:
        return False
