"""Routing replay on the tiny mixture of experts (echo/routing.py): what a forward's routers chose,
recorded; a forward made to use given choices, its gates recomputed from its own logits."""

import struct
import zlib

import numpy as np
import orjson
import pytest
import torch

from echo.config import LoraConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.models import load_model
from echo.routing import OWN, recorded, replayed, routers, routing_gap
from echo.wire.codec import (
    ProtocolError,
    RolloutLimits,
    decode_rollout,
    encode_rollout,
    pack_expert_ids,
    rollout_headers,
)
from echo.wire.messages import RolloutGroup, Routing
from tests.groups import honest_group

IDS = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))


def test_a_dense_model_has_no_routers_and_the_tiny_moe_one_a_layer():
    assert routers(load_model("tiny")[0]) == []
    model, _ = load_model("tiny-moe")
    assert [r.top_k for r in routers(model)] == [2, 2] and all(r.num_experts == 8 for r in routers(model))


def test_replaying_a_forwards_own_routing_gives_its_logits_and_other_routing_other_logits():
    model, _ = load_model("tiny-moe")
    with torch.no_grad(), recorded(model) as calls:
        plain = model(input_ids=IDS).logits
    chosen = [layer[0] for layer in calls]
    assert [c.shape for c in chosen] == [(IDS.numel(), 2)] * 2
    with torch.no_grad(), replayed(model, chosen):
        assert torch.equal(model(input_ids=IDS).logits, plain)
    with torch.no_grad():  # the model's own again outside
        assert torch.equal(model(input_ids=IDS).logits, plain)
    # Other experts for every token: the routers send each where told, and the logits move.
    other = [(c + 2) % 8 for c in chosen]
    with torch.no_grad(), replayed(model, other), recorded(model) as seen:
        moved = model(input_ids=IDS).logits
    assert all(torch.equal(s[0], o) for s, o in zip(seen, other))
    assert not torch.allclose(moved, plain, atol=1e-3)
    # OWN: no record for these tokens, the router's own top-k.
    mixed = [torch.where(torch.arange(len(o))[:, None] % 2 == 0, o, torch.full_like(o, OWN)) for o in other]
    with torch.no_grad(), replayed(model, mixed), recorded(model) as seen:
        model(input_ids=IDS)
    assert all(torch.equal(s[0][::2], o[::2]) for s, o in zip(seen, other))
    assert torch.equal(seen[0][0][1::2], chosen[0][1::2])  # the first layer's input is as before


def test_under_replay_the_router_still_learns():
    """The gates are the trainer's own softmax over the replayed experts: its gradient reaches
    the router's weight."""
    model, _ = load_model("tiny-moe")
    with torch.no_grad(), recorded(model) as calls:
        model(input_ids=IDS)
    with replayed(model, [layer[0] for layer in calls]):
        model(input_ids=IDS).logits.logsumexp(-1).sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_the_routing_gap_is_zero_for_a_routers_own_choice_and_large_for_a_made_up_one():
    model, _ = load_model("tiny-moe")
    router = routers(model)[0]
    hidden = torch.randn(500, router.weight.shape[1])
    with torch.no_grad():
        logits, _, own = router(hidden)
    assert torch.equal(routing_gap(logits, own), torch.zeros(500))
    made_up = torch.stack([torch.randperm(8)[:2] for _ in range(500)])
    gap = routing_gap(logits, made_up)
    assert (gap > 0).float().mean() > 0.5  # a random pair is rarely the top 2 of 8


class NoNewerWeights:  # the sampler's weights room with nothing new: generation goes on in chunks
    def between_chunks(self) -> int | None:
        return None


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "in-chunks"])
def test_the_engine_records_the_routing_its_forward_used_for_every_token(chunk):
    """Each completion's routing covers its prompt and its tokens (the last, never an input, a
    row of zeros); replayed in the trainer's forward over the sequence it gives the sampler's own
    log-probs, and it is the trainer's own routing but for near-ties. In chunks (partial
    rollouts) it goes on where the last chunk stopped."""
    sampling = SamplingConfig(group_size=3, max_new_tokens=16, temperature=0.9, chunk_tokens=chunk)
    engine = HFEngine("tiny-moe", LoraConfig(r=4), sampling, record_routing=True)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in ("What is 2 + 3?", "Hi")]
    groups = engine.generate(prompts, 3, seed=7, newer_weights=NoNewerWeights() if chunk else None)
    agree = []
    for prompt, group in zip(prompts, groups):
        for g in group:
            assert g.routing.shape == (len(prompt) + len(g.token_ids), 2, 2) and not g.routing[-1].any()
            assert (g.routing < 8).all()
            sequence = torch.tensor([prompt + g.token_ids])
            with torch.no_grad(), recorded(engine.model) as own:
                engine.model(input_ids=sequence)
            agree.append((own[0][0][:-1] == torch.from_numpy(g.routing[:-1, 0].astype("int64"))).all(-1).float())
            chosen = [torch.from_numpy(g.routing[:, layer].astype("int64")) for layer in range(2)]
            with torch.no_grad(), replayed(engine.model, chosen):
                logits = engine.model(input_ids=sequence).logits[0, len(prompt) - 1 : -1] / sampling.temperature
            logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
            assert torch.allclose(logprobs, torch.tensor(g.logprobs), atol=1e-4)
    assert torch.cat(agree).mean() > 0.97


SUBJECT = "echo.run.rollouts.s1"
LIMITS = RolloutLimits(group_size=4, max_new_tokens=64, routing=(2, 2, 8))


def routed_group(experts: int = 8) -> RolloutGroup:
    """An honest group with a routing: for each token, 2 layers of 2 distinct experts."""
    group = honest_group()
    tokens = len(group.prompt_token_ids) + sum(len(c.token_ids) for c in group.completions)
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(experts, 2, replace=False) for _ in range(2)] for _ in range(tokens)])
    ids[group.last_tokens()] = 0  # never an input: nothing to record
    return group.replaced(routing=Routing(layers=2, top_k=2, experts=experts, ids=ids))


def decoded(data: bytes, limits: RolloutLimits | None = LIMITS) -> RolloutGroup:
    return decode_rollout(data, rollout_headers(routed_group()), SUBJECT, limits)


def with_routing_bytes(group: RolloutGroup, shape: dict | None, body: bytes) -> bytes:
    """The group's message with its routing's shape and bytes replaced (a sampler's own encoder)."""
    data = encode_rollout(group.replaced(routing=None))
    (meta_len,) = struct.unpack_from("<I", data, 4)
    meta = orjson.loads(data[8 : 8 + meta_len])
    if shape is not None:
        meta["routing"] = {**shape, "bytes": len(body)}
    head = orjson.dumps(meta)
    return b"ECRG" + struct.pack("<I", len(head)) + head + data[8 + meta_len :] + body


def test_a_groups_routing_travels_in_the_fewest_bits_and_comes_back_whole():
    group = routed_group()
    data = encode_rollout(group)
    assert decoded(data) == group and decoded(data).routing.ids.dtype == np.uint16
    assert zlib.decompress(pack_expert_ids(group.routing.ids, 8)) == _packed(group.routing.ids, 3)  # as specified
    without = len(encode_rollout(group.replaced(routing=None)))
    # 3 bits an id, 4 ids a token (2 layers, top-2): 1.5 bytes a token (random ids do not
    # compress), and its shape in the fields.
    assert len(data) - without <= 1.5 * len(group.routing.ids) + 128
    assert decode_rollout(encode_rollout(group.replaced(routing=None)), rollout_headers(group), SUBJECT,
                          RolloutLimits(group_size=4, max_new_tokens=64)).routing is None


@pytest.mark.parametrize("change, reason, said", [
    ("in a run that replays none", "unexpected_routing", "replays no routing"),
    ("none in a run that replays", "no_routing", "each group carries it"),
    ("another model's shape", "bad_routing", "the run's model routes (2, 2, 8)"),
    ("an expert the model has not", "bad_routing", "an expert id past the 6"),
    ("one expert twice", "bad_routing", "chosen twice for token 3"),
    ("fewer tokens than the group", "bad_routing", "do not inflate"),
    ("more tokens than the group", "bad_routing", "do not inflate"),
    ("not zlib", "bad_routing", "not zlib"),
    ("a zlib bomb", "bad_routing", "do not inflate"),
    ("a shape past any model's", "bad_routing", "than the wire carries"),
])
def test_a_routing_that_is_not_the_groups_or_the_runs_is_refused_at_decode(change, reason, said):
    group = routed_group()
    shape = {"layers": 2, "top_k": 2, "experts": 8}
    tokens = len(group.routing.ids)
    packed = encode_rollout(group)[len(encode_rollout(group.replaced(routing=None))) :]
    limits = LIMITS
    if change == "in a run that replays none":
        data, limits = encode_rollout(group), RolloutLimits(group_size=4, max_new_tokens=64)
    elif change == "none in a run that replays":
        data = encode_rollout(group.replaced(routing=None))
    elif change == "another model's shape":
        data = encode_rollout(group.replaced(routing=group.routing.replaced(experts=16)))
    elif change == "an expert the model has not":  # 6 experts still take 3 bits: ids 6 and 7 fit
        ids = group.routing.ids.copy()
        ids[3, 1, 0] = 7
        data = with_routing_bytes(group, shape | {"experts": 6}, zlib.compress(_packed(ids, 3)))
        limits = RolloutLimits(group_size=4, max_new_tokens=64, routing=(2, 2, 6))
    elif change == "one expert twice":
        ids = group.routing.ids.copy()
        ids[3, 1] = [5, 5]
        data = with_routing_bytes(group, shape, zlib.compress(_packed(ids, 3)))
    elif change == "fewer tokens than the group":
        data = with_routing_bytes(group, shape, zlib.compress(_packed(group.routing.ids[:-8], 3)))
    elif change == "more tokens than the group":
        data = with_routing_bytes(group, shape, zlib.compress(_packed(np.concatenate([group.routing.ids] * 2), 3)))
    elif change == "not zlib":
        data = with_routing_bytes(group, shape, b"\x00" * len(packed))
    elif change == "a zlib bomb":  # a few KB that inflate to 100 MB: refused after the group's worth
        data, limits = with_routing_bytes(group, shape, zlib.compress(bytes(100 << 20), 9)), None
    else:
        data, limits = with_routing_bytes(group, shape | {"layers": 10_000}, packed), None
    assert tokens  # the group has routing to begin with
    with pytest.raises(ProtocolError) as refused:
        decoded(data, limits)
    assert refused.value.reason == reason and said in str(refused.value), refused.value


def _packed(ids: np.ndarray, bits: int) -> bytes:
    """Expert ids in `bits` bits each, big-endian bit order (the wire's packing, written apart)."""
    flat = ids.reshape(-1).astype(np.uint64)
    out = "".join(format(int(v), f"0{bits}b") for v in flat)
    out += "0" * (-len(out) % 8)
    return bytes(int(out[i : i + 8], 2) for i in range(0, len(out), 8))

