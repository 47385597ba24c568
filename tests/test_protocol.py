import time

import orjson
import pytest

from echo.protocol import (
    HDR_MSG_ID,
    HDR_POLICY_VERSION,
    Completion,
    ProtocolError,
    PullRequest,
    RolloutGroup,
    RunNames,
    WeightsAnnouncement,
    WeightsShard,
    decode,
    decode_rollout,
    encode,
    rollout_headers,
)


def make_group(version: int = 3, sampler: str = "s1", size: int = 2, group_id: str = "g1") -> RolloutGroup:
    return RolloutGroup(
        group_id=group_id,
        sampler_id=sampler,
        policy_version=version,
        task="math",
        prompt_index=12,
        lease=1,
        epoch=0,
        prompt_token_ids=[1, 2, 3],
        completions=[
            Completion(token_ids=[4, 5], logprobs=[-0.5, -1.0], text="<answer>3</answer>", reward=1.0, finish_reason="stop")
            for _ in range(size)
        ],
        temperature=1.0,
        engine="hf",
        dtype="float32",
        gen_seconds=0.1,
        created_at=time.time(),
    )


def test_rollout_round_trip_with_headers():
    group = make_group()
    headers = rollout_headers(group)
    assert headers[HDR_POLICY_VERSION] == "3" and headers[HDR_MSG_ID] == "g1"
    assert decode_rollout(encode(group), headers, RunNames("r").rollouts_subject(group.sampler_id)) == group


def test_other_messages_round_trip():
    shard = WeightsShard(object_name="a", size=10, sha256="0" * 64)
    ann = WeightsAnnouncement(version=2, epoch=1, kind="full", shards=[shard, shard], base_model="tiny", created_at=1.0)
    assert ann.size == 20
    req = PullRequest(request_id="r1", version=2, groups=8)
    assert decode(WeightsAnnouncement, encode(ann)) == ann
    assert decode(PullRequest, encode(req)) == req


def test_names_are_per_run_and_per_sampler():
    a, b = RunNames("a"), RunNames("b")
    assert a.rollouts_subject("s1") == "echo.a.rollouts.s1"
    assert a.rollouts_stream != b.rollouts_stream and a.weights_bucket != b.weights_bucket
    with pytest.raises(ValueError):
        a.rollouts_subject("s1.>")  # a wildcard would let a sampler publish as others
    with pytest.raises(ValueError):
        RunNames("a.b")


def _mutate(**changes) -> bytes:
    raw = orjson.loads(encode(make_group()))
    for key, value in changes.items():
        if key.startswith("c0_"):
            raw["completions"][0][key[3:]] = value
        elif value is None:
            del raw[key]
        else:
            raw[key] = value
    return orjson.dumps(raw)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"not json", "bad_json"),
        (b"[1, 2]", "bad_json"),
        (_mutate(schema_version=1), "bad_schema_version"),
        (_mutate(policy_version=None), "bad_schema"),
        (_mutate(policy_version="3"), "bad_schema"),
        (_mutate(policy_version=-1), "bad_schema"),
        (_mutate(extra_field=1), "bad_schema"),
        (_mutate(completions=[]), "bad_schema"),
        (_mutate(c0_logprobs=[-0.5]), "bad_schema"),  # not one per token
        (_mutate(c0_logprobs=[-0.5, None]), "bad_schema"),  # NaN/inf arrive as null through JSON
        (_mutate(c0_logprobs=[-0.5, 0.5]), "bad_schema"),  # a log-prob above zero
        (_mutate(c0_finish_reason="bored"), "bad_schema"),
        (_mutate(sampler_id="s1.x"), "bad_schema"),
    ],
)
def test_bad_rollouts_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ProtocolError) as e:
        decode_rollout(data, rollout_headers(make_group()), RunNames("r").rollouts_subject("s1"))
    assert e.value.reason == reason


def test_headers_must_agree_with_the_body():
    headers = rollout_headers(make_group())
    headers[HDR_POLICY_VERSION] = "9"
    with pytest.raises(ProtocolError) as e:
        decode_rollout(encode(make_group()), headers, RunNames("r").rollouts_subject("s1"))
    assert e.value.reason == "header_mismatch"


def test_the_subject_must_be_the_bodys_samplers():
    with pytest.raises(ProtocolError) as e:
        decode_rollout(encode(make_group()), rollout_headers(make_group()), RunNames("r").rollouts_subject("s2"))
    assert e.value.reason == "subject_mismatch"
