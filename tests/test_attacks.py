"""Issue 26: attacks by a client holding exactly one sampler's seed and certificate on a secured
hub, each against the real server and the real trainer code. Every test here failed on the code
before the defence it checks."""

from __future__ import annotations

import nats
import pytest

from echo.admission import GrantLedger
from echo.checkpoint import TrainerState
from echo.protocol import GrantRequest, encode
from streams.client import open_run
from streams.lease import take_lease
from streams.secure import SecureDir
from streams.server import NatsServer
from streams.weights import fetch_weights, publish_weights
from tests.conftest import TINY_BASE, tiny_config
from workers.dispatch import AsyncDispatch


@pytest.fixture
def secured(tmp_path):
    """A hub that speaks TLS only, with trainer, observer and sampler s1 credentials for run "sec"."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost", "127.0.0.1"], ["s1"])
    with NatsServer(tmp_path / "jetstream", include=secure.dir / "server.conf") as server:
        yield server, secure


async def _serving_trainer(server, secure, tmp_path):
    """The trainer of run "sec": its lease, version 0 published, granting work at version 0."""
    trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
    lease = await take_lease(trainer)
    announcement = await publish_weights(trainer, 0, [b"v0" * 100], TINY_BASE)
    dispatch = AsyncDispatch(trainer, tiny_config(tmp_path, run={"id": "sec"}), TrainerState(), GrantLedger())
    await dispatch.start()
    await dispatch.ask(0)
    return trainer, lease, announcement, dispatch


async def test_the_trainer_answers_a_grant_request_only_in_an_inbox_and_copies_no_header(secured, tmp_path):
    """Reply reflection through the trainer: a grant request on the sampler's own subject whose
    reply names the weights bucket, with `Nats-Rollup: all`, made the trainer (nats-py's respond
    copies the request's headers) purge every version; one naming another sampler's rollout
    subject put the trainer's answer there under the attacker's headers."""
    server, secure = secured
    trainer, lease, announcement, dispatch = await _serving_trainer(server, secure, tmp_path)
    names = trainer.names
    attacker = await nats.connect(server.url, **secure.credentials("sampler-s1").connect_options())
    try:
        request = encode(GrantRequest(want=1, epoch=lease.epoch, version=0))
        rollup = {"Nats-Rollup": "all", "Echo-Sampler-Id": "s2"}
        for target in (f"$O.{names.weights_bucket}.M.x", names.rollouts_subject("s2"), f"$KV.{names.state_bucket}.x"):
            await attacker.publish(names.grants_subject("s1"), request, reply=target, headers=rollup)
        # The trainer answers one sampler's requests in order: once this answer is in, it has
        # handled the reflected ones.
        answer = await attacker.request(names.grants_subject("s1"), request, timeout=5, headers={"X-Mine": "1"})
        assert not answer.headers, answer.headers  # none of the request's headers came back
        assert await fetch_weights(trainer, announcement) == [bytearray(b"v0" * 100)]  # the bucket is whole
        assert (await trainer.js.stream_info(names.rollouts_stream)).state.messages == 0
        assert "x" not in await trainer.state.keys()
    finally:
        await attacker.close()
        await dispatch.subscription.unsubscribe()
        await trainer.close()
