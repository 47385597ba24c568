"""The wire against a real nats-server: rollouts in and out, malformed input, weights."""

import asyncio

import pytest
import torch

from echo.engines.hf import HFEngine
from echo.policy import adapter_bytes
from echo.protocol import HDR_MSG_ID, HDR_POLICY_VERSION, HDR_SAMPLER_ID, TRAINER_CONSUMER, encode, rollout_headers
from echo.tasks import load_task
from streams.client import open_run
from streams.replay import read_rollouts
from streams.rollouts import publish_rollout, trainer_subscription
from streams.weights import WeightsError, WeightsFollower, fetch_weights, publish_weights
from tests.conftest import tiny_config
from tests.test_referee import REFEREE, with_completion, honest_group
from workers.sampler import Sampler
from workers.trainer import Collector


def test_collector_uses_fresh_groups_and_rejects_the_rest_with_reasons(nats_server):
    async def main():
        run = await open_run(nats_server.url, "c", "test")
        sub = await trainer_subscription(run)
        subject = run.names.rollouts_subject("s1")
        await run.js.publish(subject, b"{broken", headers={HDR_MSG_ID: "bad1", HDR_SAMPLER_ID: "s1"})
        await publish_rollout(run, honest_group(policy_version=1, group_id="stale"))  # 5 - 1 > bound
        await publish_rollout(run, honest_group(policy_version=9, group_id="future"))
        await publish_rollout(run, honest_group(policy_version=5, group_id="wrongsize", texts=["a", "b", "c"]))
        await publish_rollout(run, honest_group(policy_version=5, group_id="trained"))
        spoofed = honest_group(policy_version=5, group_id="spoofed")
        await run.js.publish(subject, encode(spoofed), headers={**rollout_headers(spoofed), HDR_POLICY_VERSION: "4"})
        liar = with_completion(honest_group(policy_version=4, group_id="liar"), reward=0.0)
        await publish_rollout(run, liar)
        await publish_rollout(run, honest_group(policy_version=5, group_id="ok"))
        await publish_rollout(run, honest_group(policy_version=5, group_id="ok"))  # a retry: de-duplicated

        collector = Collector(sub, REFEREE, max_staleness=1, trained_ids={"trained"})
        collected = await collector.collect(2, version=5)
        assert [a.group.group_id for a in collected.used] == ["liar", "ok"]
        assert collected.used[0].rewards == [1.0, 0.1]  # the trainer's rewards, not the liar's
        assert collected.reward_mismatch == {"s1": 1}
        assert collected.dropped == {4: 1} and collected.dropped_ids == ["stale"]
        assert collected.rejected == {"bad_json": 1, "future_version": 1, "wrong_group_size": 1, "header_mismatch": 1}
        assert collected.already_trained == 1
        info = await run.js.consumer_info(run.names.rollouts_stream, TRAINER_CONSUMER)
        assert info.num_pending == 0 and info.num_ack_pending == 2  # only the used wait for the step
        await collector.ack_held()
        # Nothing is lost: rejected messages stay in the stream for replay.
        records = [r async for r in read_rollouts(nats_server.url, "c")]
        assert len(records) == 8 and sum("error" in r for r in records) == 2
        await run.close()

    asyncio.run(main())


def test_weights_round_trip_and_a_wrong_digest_is_refused(nats_server, tmp_path):
    async def main():
        run = await open_run(nats_server.url, "w", "test")
        data = bytes(range(256)) * 4000  # 1 MB: several object-store chunks
        announcement = await publish_weights(run, 7, data, "tiny")
        assert await fetch_weights(run, announcement) == data
        lying = announcement.model_copy(update={"sha256": "0" * 64})
        with pytest.raises(WeightsError, match="digest_mismatch"):
            await fetch_weights(run, lying)
        await run.close()

    asyncio.run(main())


def _adapter_for_version(engine: HFEngine, version: int) -> bytes:
    """A distinct adapter per version: LoRA B matrices filled with the version number."""
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.fill_(version / 100)
    return adapter_bytes(engine.model)


def test_a_sampler_joining_after_version_3_generates_with_version_3(nats_server, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer_side = HFEngine("tiny", cfg.lora, cfg.sampling)
    adapters = [_adapter_for_version(trainer_side, v) for v in range(4)]

    async def main():
        run = await open_run(nats_server.url, cfg.run.id, "trainer")
        await trainer_subscription(run)
        for version, data in enumerate(adapters):
            await publish_weights(run, version, data, "tiny")

        sampler_run = await open_run(nats_server.url, cfg.run.id, "late-sampler")
        engine = HFEngine("tiny", cfg.lora, cfg.sampling)
        sampler = Sampler(cfg, "late", sampler_run, engine, load_task(cfg.task))
        await sampler.weights.start()
        await sampler.apply_newest()
        await sampler.generate_and_publish(1)
        await sampler.weights.stop()
        assert sampler.version == 3
        assert adapter_bytes(engine.model) == adapters[3]
        records = [r async for r in read_rollouts(nats_server.url, cfg.run.id)]
        assert [r["headers"][HDR_POLICY_VERSION] for r in records] == ["3"]
        await sampler_run.close()
        await run.close()

    asyncio.run(main())


def test_follower_refuses_an_adapter_for_another_base_model(nats_server, tmp_path):
    async def main():
        run = await open_run(nats_server.url, "b", "test")
        await publish_weights(run, 0, b"good", "tiny")
        follower = await WeightsFollower(run, "tiny").start()
        assert (await follower.wait_for(0))[1] == b"good"
        await publish_weights(run, 1, b"other", "some-other-model")
        for _ in range(100):
            if follower.failures:
                break
            await asyncio.sleep(0.02)
        assert follower.failures == {"wrong_base_model": 1}
        assert follower.ready[0].version == 0  # the old version stays
        await follower.stop()
        await run.close()

    asyncio.run(main())
