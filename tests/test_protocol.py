import struct
import time

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from echo.fleet.grants import ask_share
from echo.wire.codec import (
    ROLLOUT_MAGIC,
    ProtocolError,
    decode,
    decode_rollout,
    encode,
    encode_rollout,
    rollout_headers,
)
from echo.wire.messages import (
    Completion,
    Grant,
    GrantBudget,
    GrantRequest,
    PullRequest,
    RolloutGroup,
    SamplerStatus,
    TrainerLease,
    TrainerStatus,
    WeightsAnnouncement,
    WeightsLink,
    WeightsShard,
)
from echo.wire.names import HDR_MSG_ID, HDR_SCHEMA, HDR_VERSION, SCHEMA_VERSION, RunNames, Version
from tests.groups import honest_group, pack_rollout, unpack_rollout


def make_group(version: int = 3, sampler: str = "s1", size: int = 2, group_id: str = "g1") -> RolloutGroup:
    """An honest group with token ids small enough to read back on the wire."""
    completion = Completion(token_ids=[4, 5], logprobs=[-0.5, -1.0], text="<answer>3</answer>", claimed_reward=1.0,
                            finish_reason="stop")
    return honest_group(version=version, sampler_id=sampler, group_id=group_id, prompt_token_ids=[1, 2, 3],
                        completions=[completion] * size, created_at=time.time())


def test_rollout_round_trip_with_headers():
    group = make_group()
    headers = rollout_headers(group)
    assert headers[HDR_VERSION] == "3" and headers[HDR_MSG_ID] == "g1"
    data = encode_rollout(group)
    assert decode_rollout(data, headers, RunNames("r").rollouts_subject(group.sampler_id)) == group
    assert data[:4] == b"ECRG" and b'"text":"<answer>3</answer>"' in data  # the fields stay readable


def test_a_group_holds_its_tokens_as_read_only_arrays_and_dumps_them_as_lists():
    group = make_group()
    decoded = decode_rollout(encode_rollout(group), rollout_headers(group), RunNames("r").rollouts_subject("s1"))
    for c in (group.completions[0], decoded.completions[0]):
        assert (c.token_ids.dtype, c.logprobs.dtype) == (np.uint32, np.float32)
        assert not c.token_ids.flags.writeable and not c.logprobs.flags.writeable  # frozen, arrays too
    assert decoded.model_dump()["completions"][0]["token_ids"] == [4, 5]
    assert decoded.model_dump()["prompt_token_ids"] == [1, 2, 3]
    fields = {"logprobs": [-0.5], "text": "x", "claimed_reward": 0.0, "finish_reason": "length"}
    for bad in ([-1], [1.5], [[1]], [True]):  # what no uint32 array holds
        with pytest.raises(ValidationError, match="token ids"):
            Completion(token_ids=bad, **fields)
    with pytest.raises(ValidationError, match="empty completion"):
        Completion(**{**fields, "token_ids": [], "logprobs": []})


def test_a_rollout_costs_8_bytes_a_completion_token_plus_its_text():
    """Token ids as uint32 and log-probs as float32 (the JSON of schema 7 took about 31 bytes
    with real log-probs: bench/transport.py)."""
    long = make_group(size=16).model_copy(update={"completions": [
        Completion(token_ids=list(range(50_000, 51_024)), logprobs=[-0.25] * 1024, text="", claimed_reward=0.0,
                   finish_reason="length")] * 16})
    per_token = len(encode_rollout(long)) / (16 * 1024)
    assert 8.0 <= per_token < 8.2, per_token


def test_other_messages_round_trip():
    shard = WeightsShard(object_name="a", size=10, sha256="0" * 64)
    ann = WeightsAnnouncement(version=2, term=1, kind="full", shards=[shard, shard], base_model="tiny", created_at=1.0)
    assert ann.size == 20
    req = PullRequest(request_id="r1", term=1, version=2, groups=8)
    assert decode(WeightsAnnouncement, encode(ann)) == ann
    assert decode(PullRequest, encode(req)) == req


def test_a_delta_is_announced_with_its_digest_and_a_chain_without_gaps_from_a_whole_version():
    shard = WeightsShard(object_name="a", size=10, sha256="0" * 64)

    def link(version: int, delta_of: int | None) -> dict:
        return WeightsLink(version=version, shards=[shard], delta_of=delta_of, digest="a" * 64).model_dump()

    def announced(chain: list[dict], **fields) -> dict:
        return {"schema_version": 17, "version": 3, "epoch": 1, "kind": "full", "shards": [shard.model_dump()],
                "base_model": "tiny", "created_at": 1.0, "digest": "b" * 64, "delta_of": 2, "chain": chain} | fields

    ann = decode(WeightsAnnouncement, orjson.dumps(announced([link(0, None), link(1, 0), link(2, 1)])))
    assert [(k.version, k.delta_of) for k in ann.links] == [(0, None), (1, 0), (2, 1), (3, 2)]
    assert decode(WeightsAnnouncement, encode(ann)) == ann
    for chain, fields in [([link(0, None), link(2, 1)], {}),  # a gap: version 1 missing
                          ([link(1, 0), link(2, 1)], {}),  # no whole version to begin from
                          ([link(0, None), link(1, 0), link(2, 1)], {"digest": ""}),  # nothing to check it by
                          ([link(0, None)], {"delta_of": None})]:  # a whole version names no chain
        with pytest.raises(ProtocolError, match="bad_schema"):
            decode(WeightsAnnouncement, orjson.dumps(announced(chain, **fields)))


def test_names_are_per_run_and_per_sampler():
    a, b = RunNames("a"), RunNames("b")
    assert a.rollouts_subject("s1") == "echo.a.rollouts.s1"
    assert a.rollouts_stream != b.rollouts_stream and a.weights_bucket != b.weights_bucket
    with pytest.raises(ValueError):
        a.rollouts_subject("s1.>")  # a wildcard would let a sampler publish as others
    with pytest.raises(ValueError):
        RunNames("a.b")


def _mutate(**changes) -> bytes:
    raw = unpack_rollout(encode_rollout(make_group()))
    for key, value in changes.items():
        if key.startswith("c0_"):
            raw["completions"][0][key[3:]] = value
        elif value is None:
            del raw[key]
        else:
            raw[key] = value
    return pack_rollout(raw)


def _fields_as(meta: bytes) -> bytes:
    """A message whose JSON part is `meta`."""
    return ROLLOUT_MAGIC + struct.pack("<I", len(meta)) + meta


GOOD = encode_rollout(make_group())


@pytest.mark.parametrize(
    "data, reason",
    [
        (orjson.dumps(make_group().model_dump()), "bad_encoding"),  # the JSON of schema 7
        (b"", "bad_encoding"),
        (GOOD[:-4], "bad_encoding"),  # a log-prob short
        (GOOD + b"\0" * 4, "bad_encoding"),  # four bytes too many
        (ROLLOUT_MAGIC + struct.pack("<I", 10**6) + b"{}", "bad_encoding"),  # fields longer than the message
        (_fields_as(b"not json"), "bad_json"),
        (_fields_as(b"[1, 2]"), "bad_json"),
        (_fields_as(b'{"schema_version": 9, "prompt_tokens": 1}'), "bad_schema"),  # no completion counts
        (_fields_as(b'{"prompt_tokens": -1, "completion_tokens": [], "completions": []}'), "bad_schema"),
        (_mutate(schema_version=1), "bad_schema_version"),
        (_mutate(version=None), "bad_schema"),
        (_mutate(version="3"), "bad_schema"),
        (_mutate(version=-1), "bad_schema"),
        (_mutate(extra_field=1), "bad_schema"),
        (_mutate(completions=[]), "bad_schema"),
        (_mutate(c0_token_ids=[], c0_logprobs=[]), "bad_schema"),  # an empty completion
        (_mutate(c0_logprobs=[-0.5, float("nan")]), "bad_schema"),
        (_mutate(c0_logprobs=[-0.5, float("-inf")]), "bad_schema"),
        (_mutate(c0_logprobs=[-0.5, 0.5]), "bad_schema"),  # a log-prob above zero
        (_mutate(c0_finish_reason="bored"), "bad_schema"),
        (_mutate(sampler_id="s1.x"), "bad_schema"),
    ],
)
def test_bad_rollouts_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ProtocolError) as e:
        decode_rollout(data, rollout_headers(make_group()), RunNames("r").rollouts_subject("s1"))
    assert e.value.reason == reason


@pytest.mark.parametrize("header", list(rollout_headers(make_group())))
def test_every_header_must_agree_with_the_body(header):
    headers = rollout_headers(make_group())
    decode_rollout(GOOD, headers, RunNames("r").rollouts_subject("s1"))
    headers[header] += "9"
    with pytest.raises(ProtocolError) as e:
        decode_rollout(GOOD, headers, RunNames("r").rollouts_subject("s1"))
    assert e.value.reason == "header_mismatch" and header in str(e.value)


def test_the_subject_must_be_the_bodys_samplers():
    with pytest.raises(ProtocolError) as e:
        decode_rollout(GOOD, rollout_headers(make_group()), RunNames("r").rollouts_subject("s2"))
    assert e.value.reason == "subject_mismatch"


def test_a_group_recorded_in_schema_13_still_decodes_and_one_mixing_the_names_does_not():
    """Schema 14 renamed the wire's "lease" to "slot": replay of a recorded run, and a restarted
    trainer's unread groups, are in schema 13."""
    group = make_group()
    subject = RunNames("r").rollouts_subject("s1")
    raw = unpack_rollout(encode_rollout(group))
    recorded = pack_rollout(raw | {"schema_version": 13, "lease": raw.pop("slot"),
                                   "policy_version": raw.pop("version"), "epoch": raw.pop("term")})
    headers = rollout_headers(group) | {HDR_SCHEMA: "13"}
    assert decode_rollout(recorded, headers, subject) == group
    with pytest.raises(ProtocolError, match="header_mismatch"):
        decode_rollout(recorded, rollout_headers(group), subject)  # its header must say what its body does
    for mixed in (_mutate(lease=group.slot, slot=None), _mutate(schema_version=12, slot=None, lease=group.slot)):
        with pytest.raises(ProtocolError):
            decode_rollout(mixed, rollout_headers(group), subject)
    assert decode(Grant, orjson.dumps({"schema_version": 13, "leases": [], "more": True})).more
    with pytest.raises(ProtocolError, match="one for each slot"):  # since 19 a grant names each slot's prompt
        decode(Grant, orjson.dumps({"schema_version": 13, "leases": [4, 5], "more": True}))



def test_messages_recorded_in_schema_19_decode_under_the_names_of_20():
    """Schema 20 gave each word one meaning: a group's `policy_version` is its `version`, a
    sampler's `incarnation` its `process`, LearnerStatus a TrainerStatus (same fields, same key).
    A recorded run's groups, and a sampler or trainer of 19, still read; a message naming a field
    both ways, or one of 20 using an old name, does not."""
    group = make_group()
    subject = RunNames("r").rollouts_subject("s1")
    raw = unpack_rollout(encode_rollout(group))
    version, term = raw.pop("version"), raw.pop("term")
    recorded = pack_rollout(raw | {"schema_version": 19, "policy_version": version, "epoch": term})
    assert decode_rollout(recorded, rollout_headers(group) | {HDR_SCHEMA: "19"}, subject) == group
    beat = {"schema_version": 19, "sampler_id": "s1", "version": 3, "groups_published": 0, "weight_failures": {},
            "updated_at": 1.0, "incarnation": "ab12"}
    assert decode(SamplerStatus, orjson.dumps(beat)).process == "ab12"
    asked = {"schema_version": 19, "want": 2, "epoch": 1, "version": 3, "incarnation": "ab12"}
    assert decode(GrantRequest, orjson.dumps(asked)) == GrantRequest(want=2, term=1, version=3, process="ab12")
    pace = {"schema_version": 19, "step_s": 1.0, "groups_per_step": 4, "max_staleness": 1, "version": 3,
            "utilisation": 0.5, "updated_at": 1.0}
    assert decode(TrainerStatus, orjson.dumps(pace)).version == 3
    both = pack_rollout(raw | {"schema_version": 19, "policy_version": version, "version": version, "epoch": term})
    with pytest.raises(ProtocolError, match="bad_schema"):
        decode_rollout(both, rollout_headers(group) | {HDR_SCHEMA: "19"}, subject)
    with pytest.raises(ProtocolError, match="bad_schema"):
        decode_rollout(_mutate(policy_version=3, version=None), rollout_headers(group), subject)
    with pytest.raises(ProtocolError, match="bad_schema"):
        decode(SamplerStatus, orjson.dumps(beat | {"schema_version": SCHEMA_VERSION}))


def test_messages_of_27_read_under_the_names_of_28_the_term_and_a_claimed_reward():
    """Schema 28 calls the trainer's count of takeovers its term (an epoch is a pass over the data
    in verl, TRL and PPO), and a completion's reward from its sampler a claim: a recorded group,
    lease, announcement, pull request and request for work of 27 still read; one of 28 naming an
    epoch, or a completion's reward, does not."""
    group = make_group()
    subject = RunNames("r").rollouts_subject("s1")
    raw = unpack_rollout(encode_rollout(group))
    completions = [{("reward" if k == "claimed_reward" else k): v for k, v in c.items()} for c in raw["completions"]]
    recorded = pack_rollout(raw | {"schema_version": 27, "epoch": raw.pop("term"), "completions": completions})
    assert decode_rollout(recorded, rollout_headers(group) | {HDR_SCHEMA: "27"}, subject) == group
    with pytest.raises(ProtocolError, match="bad_schema"):  # 28 with the old name
        decode_rollout(pack_rollout(raw | {"completions": completions}), rollout_headers(group), subject)
    lease = {"schema_version": 27, "epoch": 4, "holder": "h", "process": "ab"}
    assert decode(TrainerLease, orjson.dumps(lease)).term == 4
    shard = WeightsShard(object_name="w-0", size=1, sha256="0" * 64)
    announced = {"schema_version": 27, "version": 3, "epoch": 2, "kind": "lora", "shards": [shard.model_dump()],
                 "base_model": "tiny", "created_at": 1.0}
    assert decode(WeightsAnnouncement, orjson.dumps(announced)).term_version == Version(2, 3)
    pulled = {"schema_version": 27, "request_id": "r1", "epoch": 2, "version": 3, "groups": 8}
    assert decode(PullRequest, orjson.dumps(pulled)).term == 2
    asked = {"schema_version": 27, "want": 2, "epoch": 2, "version": 3, "process": "ab12"}
    assert decode(GrantRequest, orjson.dumps(asked)).term == 2
    with pytest.raises(ProtocolError, match="bad_schema"):
        decode(GrantRequest, orjson.dumps(asked | {"schema_version": SCHEMA_VERSION}))
    with pytest.raises(ProtocolError, match="bad_schema"):
        decode(GrantRequest, orjson.dumps(asked | {"term": 2}))  # both names at once


def test_a_budget_of_25_reads_as_waking_every_idle_sampler_and_26_bounds_its_counts():
    """Schema 26: a budget says how many slots were open and samplers idle, and its draw; one of
    25 (no counts) reads as 0, which wakes every idle sampler, as it did."""
    old = decode(GrantBudget, orjson.dumps({"schema_version": 25, "version": 3, "allowance": 8, "groups_per_step": 4}))
    assert (old.open, old.idle, old.draw) == (0, 0, 0) and ask_share(old.open, old.idle) == 1.0
    new = {"schema_version": SCHEMA_VERSION, "version": 3, "allowance": 8, "groups_per_step": 4, "open": 4,
           "idle": 1000, "draw": 2}
    assert decode(GrantBudget, orjson.dumps(new)).idle == 1000
    for bad in ({"open": -1}, {"idle": 2**63}, {"draw": "1"}, {"again": 1}):
        with pytest.raises(ProtocolError):
            decode(GrantBudget, orjson.dumps(new | bad))


def test_a_grant_of_26_reads_as_no_wait_and_27_bounds_the_version_it_names():
    """Schema 27: a grant refusing a sampler too slow for its version names the version it waits
    for; one of 26 reads as none (0), and the sampler's draws wake it as they did."""
    old = decode(Grant, orjson.dumps({"schema_version": 26, "slots": [], "prompts": [], "more": False}))
    assert old.wait_version == 0
    new = {"schema_version": SCHEMA_VERSION, "slots": [], "prompts": [], "more": False, "wait_version": 8}
    assert decode(Grant, orjson.dumps(new)).wait_version == 8
    for bad in ({"wait_version": -1}, {"wait_version": 2**63}, {"wait_version": "8"}):
        with pytest.raises(ProtocolError):
            decode(Grant, orjson.dumps(new | bad))


def test_a_heartbeat_of_24_reads_as_one_rank_never_restarted_and_25_says_why_a_split_one_restarted():
    """Schema 25: a sampler whose model is split over several processes says how many, how many
    times their group was lost, and why the last time; a beat of 24 reads as one rank. The why is
    a label: a control character in it is refused at decode (it reaches terminals and the page)."""
    beat = {"schema_version": 24, "sampler_id": "s1", "version": 3, "groups_published": 0, "weight_failures": {},
            "updated_at": 1.0, "process": "ab12"}
    old = decode(SamplerStatus, orjson.dumps(beat))
    assert (old.ranks, old.ranks_restarted, old.rank_lost) == (1, 0, "")
    split = beat | {"schema_version": SCHEMA_VERSION, "ranks": 2, "ranks_restarted": 1,
                    "rank_lost": "rank 1 exited with code -9"}
    assert decode(SamplerStatus, orjson.dumps(split)).rank_lost == "rank 1 exited with code -9"
    for bad in ({"rank_lost": "rank 1 \x1b[2Jexited"}, {"ranks": 0}, {"ranks": 65}, {"rank_lost": "x" * 257},
                {"ranks_restarted": -1}):
        with pytest.raises(ProtocolError):
            decode(SamplerStatus, orjson.dumps(split | bad))


def _spanning(changes: list[dict], version: int = 3, lengths=(6, 3)) -> RolloutGroup:
    """A group newer weights took over at `changes` (partial rollouts)."""
    completions = [Completion(token_ids=list(range(4, 4 + n)), logprobs=[-0.5] * n, text="x", claimed_reward=0.0,
                              finish_reason="length").model_dump() for n in lengths]
    return make_group(version).replaced(completions=completions, version_changes=changes)


def test_a_group_sampled_across_versions_says_where_each_took_over_and_travels_so():
    group = _spanning([{"at": 2, "version": 4}, {"at": 5, "version": 6}])
    data = encode_rollout(group)
    assert decode_rollout(data, rollout_headers(group), RunNames("r").rollouts_subject("s1")) == group
    assert b'"version_changes":[{"at":2,"version":4},{"at":5,"version":6}]' in data  # compact: change points
    assert group.newest_version == 6 and make_group(3).newest_version == 3
    assert [group.sampled_from(oldest) for oldest in (3, 4, 5, 6, 7)] == [0, 2, 5, 5, 6]
    assert make_group(3).sampled_from(4) == 2  # none of it: its longest completion's length


@pytest.mark.parametrize("changes", [
    [{"at": 3, "version": 5}, {"at": 3, "version": 6}],  # two at one token
    [{"at": 2, "version": 5}, {"at": 4, "version": 5}],  # not newer
    [{"at": 6, "version": 4}],  # past every completion's last token
    [{"at": 2, "version": 3}],  # not newer than the version that began it
    [{"at": 0, "version": 4}],  # before the first token
])
def test_version_changes_out_of_order_are_refused(changes):
    raw = _spanning([]).model_dump()
    raw["version_changes"] = changes
    with pytest.raises(ProtocolError) as refused:
        decode_rollout(pack_rollout(raw), rollout_headers(make_group(3)), RunNames("r").rollouts_subject("s1"))
    assert refused.value.reason == "bad_schema" and "version_changes" in str(refused.value)


def _episode(observations: list[dict], length: int = 10) -> dict:
    """A group whose first completion is a multi-turn episode: `length` tokens, the environment's
    where `observations` say."""
    raw = make_group().model_dump()
    logprobs = [-0.5] * length
    for o in observations:
        span = slice(o["at"], o["at"] + o["tokens"])
        logprobs[span] = [0.0] * len(logprobs[span])
    raw["completions"][0] |= {"token_ids": list(range(4, 4 + length)), "logprobs": logprobs,
                              "observations": observations, "finish_reason": "length"}
    return raw


def test_a_multi_turn_episode_travels_exactly_with_its_observations_as_turn_boundaries():
    raw = _episode([{"at": 2, "tokens": 3}, {"at": 7, "tokens": 1}])
    group = RolloutGroup.model_validate(raw)
    data = encode_rollout(group)
    decoded = decode_rollout(data, rollout_headers(group), RunNames("r").rollouts_subject("s1"))
    assert decoded == group and np.array_equal(decoded.completions[0].token_ids, np.arange(4, 14))
    assert b'"observations":[{"at":2,"tokens":3},{"at":7,"tokens":1}]' in data  # compact: boundaries
    episode = decoded.completions[0]
    assert episode.model_turns() == [(0, 2), (5, 7), (8, 10)]
    assert episode.model_mask().tolist() == [True, True, False, False, False, True, True, False, True, True]
    assert decoded.completions[1].model_turns() == [(0, 2)] and decoded.completions[1].model_mask().all()


@pytest.mark.parametrize("observations", [
    [{"at": 0, "tokens": 2}],  # before the model's first turn
    [{"at": 2, "tokens": 3}, {"at": 5, "tokens": 1}],  # no model turn between the two
    [{"at": 6, "tokens": 2}, {"at": 2, "tokens": 2}],  # out of order
    [{"at": 7, "tokens": 3}],  # the episode ends with an observation: the model has the last turn
    [{"at": 8, "tokens": 5}],  # past the last token
    [{"at": 2, "tokens": 0}],  # empty
])
def test_observations_out_of_place_are_refused(observations):
    with pytest.raises(ProtocolError) as refused:
        decode_rollout(pack_rollout(_episode(observations)), rollout_headers(make_group()),
                       RunNames("r").rollouts_subject("s1"))
    assert refused.value.reason == "bad_schema" and "observations" in str(refused.value)
