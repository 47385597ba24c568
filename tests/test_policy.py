"""The policy on the tiny model: adapters move between model instances exactly, and the
engine's behaviour log-probs are what the trainer computes for the same tokens."""

import pytest
import torch

from echo.config import LoraConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.models import load_model
from echo.policy import AdapterMismatch, adapter_bytes, add_lora, make_batch, sequence_logprobs

SAMPLING = SamplingConfig(group_size=4, max_new_tokens=12, temperature=0.7)


@pytest.fixture(scope="module")
def engines():
    return HFEngine("tiny", LoraConfig(r=4), SAMPLING), HFEngine("tiny", LoraConfig(r=4), SAMPLING)


def test_tiny_base_model_is_the_same_in_every_process():
    a, _ = load_model("tiny")
    b, _ = load_model("tiny")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_adapter_moves_between_instances_and_reproduces_logits(engines):
    source, target = engines
    with torch.no_grad():
        for name, p in source.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    target.load_adapter(adapter_bytes(source.model))
    ids = torch.tensor([source.encode_chat([{"role": "user", "content": "What is 1 + 1?"}])])
    with torch.no_grad():
        assert torch.equal(source.model(input_ids=ids).logits, target.model(input_ids=ids).logits)


@pytest.mark.parametrize("data", [b"garbage", None])
def test_a_mismatched_adapter_is_refused_and_the_old_one_kept(engines, data):
    _, target = engines
    before = adapter_bytes(target.model)
    if data is None:  # a well-formed adapter of another rank
        other, _ = load_model("tiny")
        data = adapter_bytes(add_lora(other, LoraConfig(r=8)))
    with pytest.raises(AdapterMismatch):
        target.load_adapter(data)
    assert adapter_bytes(target.model) == before


def test_behaviour_logprobs_match_the_trainers(engines):
    engine, _ = engines
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in ("What is 2 + 3?", "Hi")]
    groups = engine.generate(prompts, 4)
    assert [len(g) for g in groups] == [4, 4]
    sequences = [(p, g.token_ids, g.logprobs) for p, group in zip(prompts, groups) for g in group]
    batch = make_batch(sequences, engine.tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = sequence_logprobs(engine.model, batch, SAMPLING.temperature)
    diff = (logprobs - batch.behaviour_logprobs)[batch.completion_mask]
    assert diff.numel() == sum(len(g.token_ids) for group in groups for g in group)
    assert diff.abs().max() < 1e-4  # on-policy, the importance ratio is 1
    for group in groups:
        for g in group:
            assert g.finish_reason in ("stop", "length")
            assert len(g.token_ids) <= SAMPLING.max_new_tokens
            assert (g.token_ids[-1] == engine.tokenizer.eos_token_id) == (g.finish_reason == "stop")
