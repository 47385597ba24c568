"""Routing replay on the tiny mixture of experts (echo/routing.py): what a forward's routers chose,
recorded; a forward made to use given choices, its gates recomputed from its own logits."""

import pytest
import torch

from echo.config import LoraConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.models import load_model
from echo.routing import OWN, recorded, replayed, routers, routing_gap

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

