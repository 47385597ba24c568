"""Routing replay on the tiny mixture of experts (echo/trust/routing.py): what a forward's routers chose,
recorded; a forward made to use given choices, its gates recomputed from its own logits."""

import struct
import zlib

import numpy as np
import orjson
import pytest
import torch

from echo.config import ConfigError, LoraConfig, SamplingConfig, TaskConfig
from echo.engines import make_engine
from echo.engines.hf import HFEngine, PagedEngine
from echo.model.loading import load_model
from echo.model.policy import make_policy, packed_logprobs
from echo.tasks.episodes import load_environment
from echo.train.learner import Batch, ForgedInStep, Forward, HeldProof, Rewarded, make_optimizer, train_step
from echo.trust.proof import ProofSettings, SamplingProof, logprob_gap
from echo.trust.routing import OWN, RoutingReplay, recorded, replayed, routers, routing_gap
from echo.weights.shards import load_tensors, policy_tensors
from echo.wire.codec import (
    ProtocolError,
    RolloutLimits,
    decode_rollout,
    encode_rollout,
    pack_expert_ids,
    rollout_headers,
)
from echo.wire.messages import RolloutGroup, Routing
from echo.wire.names import Version
from tests.conftest import tiny_config
from tests.groups import TASK, honest_group, turns_end_often
from workers.sampler.generation import generate_groups
from workers.trainer.model import Ranks, TrainerModel

IDS = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))


def test_a_dense_model_has_no_routers_and_the_tiny_moe_one_a_layer():
    assert routers(load_model("tiny")[0]) == []
    model, _ = load_model("tiny-moe")
    assert [r.top_k for r in routers(model)] == [2, 2] and all(r.num_experts == 8 for r in routers(model))


def test_vllms_routed_experts_become_the_moe_layers_rows_an_engine_records():
    """vLLM returns every decoder layer's experts (uint8 up to 256 experts), over the prompt and
    the completion but its last token; a model may route in some layers only (mlp_only_layers).
    The rows kept are the MoE layers', as the HF engines record them, the last row zeros."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from echo.engines.vllm import routed_rows
    from echo.model.loading import byte_tokenizer, model_on_meta
    from echo.trust.routing import router_layers

    assert router_layers(model_on_meta("tiny-moe")) == [0, 1]
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
                            num_experts_per_tok=2, mlp_only_layers=[1], vocab_size=len(byte_tokenizer()))
    with torch.device("meta"):
        assert router_layers(Qwen3MoeForCausalLM(config)) == [0, 2]
    tokens = 7
    every_layer = np.random.default_rng(0).integers(0, 8, (tokens - 1, 3, 2)).astype(np.uint8)
    every_layer[:, 1] = 0  # a dense layer: no experts
    rows = routed_rows(every_layer, [0, 2], 2, tokens)
    assert rows.dtype == np.uint16 and rows.shape == (tokens, 2, 2)
    assert np.array_equal(rows[:-1], every_layer[:, [0, 2]]) and not rows[-1].any()
    whole = np.concatenate([every_layer, every_layer[:1]])  # a row for the last token too: not kept
    assert np.array_equal(routed_rows(whole, [0, 2], 2, tokens), rows)
    for wrong in (None, every_layer[:-1], every_layer[:, :2], every_layer[..., :1]):
        with pytest.raises(RuntimeError, match="routed experts"):
            routed_rows(wrong, [0, 2], 2, tokens)


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


@pytest.mark.parametrize("engine_class, chunk", [(HFEngine, 0), (HFEngine, 5), (PagedEngine, 0)],
                         ids=["whole", "in-chunks", "paged"])
def test_the_engine_records_the_routing_its_forward_used_for_every_token(engine_class, chunk):
    """Each completion's routing covers its prompt and its tokens (the last, never an input, a
    row of zeros); replayed in the trainer's forward over the sequence it gives the sampler's own
    log-probs, and it is the trainer's own routing but for near-ties. In chunks (partial
    rollouts) it goes on where the last chunk stopped."""
    sampling = SamplingConfig(group_size=3, max_new_tokens=16, temperature=0.9, chunk_tokens=chunk)
    engine = engine_class("tiny-moe", LoraConfig(r=4), sampling, record_routing=True)
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



# --- replayed by the trainer: its forwards, the proof, the step ---------------------------------

def _sampler_and_trainer(chunk: int = 0):
    """A sampler's engine recording routing (its adapter made non-zero), and a trainer's proof
    over a model of its own holding the same weights, the run replaying routing."""
    sampling = SamplingConfig(group_size=3, max_new_tokens=12, temperature=0.9, chunk_tokens=chunk)
    engine = HFEngine("tiny-moe", LoraConfig(r=4), sampling, record_routing=True)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    trainer = make_policy(load_model("tiny-moe")[0], LoraConfig(r=4))
    load_tensors(trainer, policy_tensors(engine.model))
    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id,
                          ProofSettings(sampling.temperature, 1.0, 0.01, 2, routing_margin=0.05))
    proof.remember(0)
    return engine, sampling, proof


def _forge_routing(proof: SamplingProof, group: RolloutGroup) -> RolloutGroup:
    """The group with made-up experts for every token, and the log-probs the policy gives its
    tokens under them: what a sampler that wants its tokens scored under other experts sends."""
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.choice(8, 2, replace=False) for _ in range(2)] for _ in range(len(group.routing.ids))])
    ids[group.last_tokens()] = 0
    forged = group.replaced(group_id="forged", routing=group.routing.model_copy(update={"ids": ids.astype(np.uint16)}))
    replay = RoutingReplay.of([(forged, list(range(len(forged.completions))))])
    with torch.no_grad():
        logprobs, _, _ = packed_logprobs(proof.model, [forged.prompt_token_ids], [c.token_ids for c in forged.completions],
                                         [0] * len(forged.completions), proof.temperature, proof.pad_id, replay=replay)
    return forged.replaced(completions=[c.replaced(logprobs=logprobs[i, : len(c.token_ids)].tolist())
                                        for i, c in enumerate(forged.completions)])


def test_the_trainer_replays_the_recorded_routing_and_a_made_up_one_is_forged_routing():
    """The sampler's groups carry their routing (the prompt's once, then each completion's); the
    trainer's packed forward over two groups at once, replaying it, gives the sampler's own
    log-probs with no routing gap. Made-up experts, sent with the log-probs the policy gives under
    them, pass the log-prob check (a trainer that trusts routing trains on them) and are
    forged_routing."""
    engine, sampling, proof = _sampler_and_trainer()
    groups = generate_groups(engine, TASK, [TASK.prompt(1), TASK.prompt(2)], sampling, "s1", Version(0, 0), [1, 2],
                             seed=5)
    for group in groups:
        routing = group.routing
        assert (routing.layers, routing.top_k, routing.experts) == (2, 2, 8)
        assert len(routing.ids) == len(group.prompt_token_ids) + sum(len(c.token_ids) for c in group.completions)
    replay = RoutingReplay.of([(g, list(range(3))) for g in groups])
    claimed = [c for g in groups for c in g.completions]
    with torch.no_grad():
        logprobs, _, _ = packed_logprobs(proof.model, [g.prompt_token_ids for g in groups],
                                         [c.token_ids for c in claimed], [0, 0, 0, 1, 1, 1], sampling.temperature,
                                         proof.pad_id, replay=replay)
    assert logprob_gap(claimed, logprobs) < 1e-4 and float(replay.gaps.max()) < 1e-4

    honest = proof.check(groups[0])
    assert honest.gap < 1e-4 and honest.routing < 1e-4 and proof.forged(groups[0], honest) is None
    forged = _forge_routing(proof, groups[0])
    checked = proof.check(forged)
    assert checked.gap < 1e-4 and checked.routing > 0.05  # its log-probs are the policy's under its routing
    assert proof.forged(forged, checked) == "forged_routing"
    assert "s1" in proof.suspects


def test_forged_routing_among_honest_groups_proven_together_is_found_from_the_first_group():
    """Groups proven together: the intake proves every group of an older version, a step's together
    (check_many: one forward of several groups, each replaying its own routing). A made-up
    routing among honest groups is forged_routing; the honest ones pass."""
    engine, sampling, proof = _sampler_and_trainer()
    groups = generate_groups(engine, TASK, [TASK.prompt(1), TASK.prompt(2)], sampling, "s1", Version(0, 0), [1, 2],
                             seed=5)
    proof.remember(1)  # the trainer moved on: the groups are a version behind it
    forged = _forge_routing(proof, groups[0]).replaced(sampler_id="s9")
    checks = proof.check_many([groups[0], forged, groups[1]])
    assert [proof.forged(g, checks[g.group_id]) for g in (groups[0], forged, groups[1])] == [None, "forged_routing",
                                                                                            None]
    assert proof.suspects == {"s9"}


def test_a_partial_rollouts_routing_is_replayed_under_each_version_that_sampled_it():
    """Generated in chunks, each under the version then held: the proof's forward replays each
    version's tokens with the routing they were sampled with."""
    engine, sampling, proof = _sampler_and_trainer(chunk=4)
    proof.remember(1)  # the same weights under a second version, swapped in after the first chunk
    versions = iter([1])

    class NewerOnce:
        def between_chunks(self):
            return next(versions, None)

    [group] = generate_groups(engine, TASK, [TASK.prompt(3)], sampling, "s1", Version(0, 0), [1], NewerOnce(), seed=2)
    assert group.version_changes and group.version_changes[0].version == 1
    honest = proof.check(group)
    assert honest.gap < 1e-4 and honest.routing < 1e-4 and proof.forged(group, honest) is None
    forged = _forge_routing(proof, group)
    assert proof.forged(forged, proof.check(forged)) == "forged_routing"


def test_the_step_finds_forged_routing_in_its_own_forward_before_any_update(tmp_path):
    """The groups of the version the trainer holds are proved by the step's forward, which
    replays their routing: a made-up routing is found there, and nothing is updated."""
    engine, sampling, proof = _sampler_and_trainer()
    cfg = tiny_config(tmp_path, model={"name": "tiny-moe"}, sampling=sampling.model_dump(),
                      algorithm={"router_replay": "replay"}, trainer={"micro_batch_tokens": 64, "pack_groups": "on"})
    groups = generate_groups(engine, TASK, [TASK.prompt(4), TASK.prompt(5)], sampling, "s1", Version(0, 0), [1, 2],
                             seed=9)
    batch = [groups[0], _forge_routing(proof, groups[1])]
    model, optimizer = proof.model, make_optimizer(proof.model, cfg)
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}

    def judge(checked):
        return proof.judged_in_step({g.group_id: g for g in batch}, checked)

    forward = Forward.of(model, cfg, proof.pad_id)
    with pytest.raises(ForgedInStep) as caught:
        train_step(forward, optimizer, Batch([Rewarded(g, [1.0, 0.0, 0.0]) for g in batch]),
                   held=HeldProof(0, proof.noise_key, judge))
    assert caught.value.forged == {"forged": "forged_routing"}
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters() if p.requires_grad)
    stats = train_step(forward, optimizer, Batch([Rewarded(g, [1.0, 0.0, 0.0]) for g in groups]),
                       held=HeldProof(0, proof.noise_key, lambda checked: proof.judged_in_step(
                           {g.group_id: g for g in groups}, checked)))
    assert stats["passes"] >= 1 and proof.counts["passed"] == 2


def test_routing_replay_that_cannot_work_is_refused_at_start_naming_the_field(tmp_path):
    """A dense model (on either side): one line at start, not groups refused later."""
    moe = {"router_replay": "replay"}
    dense = tiny_config(tmp_path, algorithm=moe)
    with pytest.raises(ConfigError, match="router_replay.*dense"):
        make_engine(dense, "s1")
    with pytest.raises(ConfigError, match="router_replay.*dense"):
        TrainerModel(dense, Ranks("cpu"))
    assert make_engine(tiny_config(tmp_path, model={"name": "tiny-moe"}, algorithm=moe), "s1").routing == (2, 2, 8)


def test_an_episodes_routing_is_replayed_each_token_as_the_forward_that_first_read_it_routed_it():
    """A multi-turn episode's routing: its turns' tokens as their turns routed them, each
    observation (and the turn's last token before it) as the next turn's prefill did. The trainer
    replaying it over the whole episode gets the sampler's log-probs, no routing gap; an
    observation's experts made up are forged_routing."""
    engine, sampling, proof = _sampler_and_trainer()
    sampling = sampling.model_copy(update={"max_new_tokens": 256, "group_size": 2})
    env = load_environment(TaskConfig(name="math_tools"))
    prompts = [env.prompt(i) for i in range(2)]
    prompt_ids = [engine.encode_chat(p.messages) for p in prompts]
    turns_end_often([proof.model, engine.model], prompt_ids[0])
    groups = generate_groups(engine, env, prompts, sampling, "s1", Version(0, 0), [1, 2], seed=4)
    assert all(len(c.observations) >= 1 for g in groups for c in g.completions)  # two turns or more
    for group in groups:
        assert len(group.routing.ids) == len(group.prompt_token_ids) + sum(len(c.token_ids) for c in group.completions)
        checked = proof.check(group)
        assert checked.gap < 1e-4 and checked.routing < 1e-4 and proof.forged(group, checked) is None, checked

    group, first = groups[0], groups[0].completions[0]
    observation = len(group.prompt_token_ids) + first.observations[0].at + 1  # an observation's second token
    ids = group.routing.ids.copy()
    ids[observation] = (ids[observation] + 1) % 8  # other experts, still distinct
    forged = group.replaced(routing=group.routing.model_copy(update={"ids": ids}))
    assert proof.forged(forged, proof.check(forged)) == "forged_routing"
