"""Sequential mode on the wire: the trainer publishes a pull request (version, number of groups)
on the pull subject; samplers ask it for the request's groups a few at a time (streams/grants.py),
so a fast sampler generates more of them than a slow one and none is generated twice."""

from __future__ import annotations

from echo.wire.codec import encode
from echo.wire.messages import PullRequest
from streams.client import RunClient, publish_once


async def publish_pull_request(run: RunClient, request: PullRequest) -> None:
    await publish_once(run, run.names.pull_subject, encode(request))
