"""The policy on the tiny model: adapters move between model instances exactly, and the
engine's behaviour log-probs are what the trainer computes for the same tokens."""

import pytest
import torch

from echo.algorithms.grpo import token_logprobs
from echo.config import LoraConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.models import load_model
from echo.policy import AdapterMismatch, adapter_bytes, add_lora, group_logprobs

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
    with torch.no_grad():  # a non-trivial adapter, so the LoRA path is part of the check
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in ("What is 2 + 3?", "Hi")]
    groups = engine.generate(prompts, 4)
    assert [len(g) for g in groups] == [4, 4]
    for prompt, group in zip(prompts, groups):
        with torch.no_grad():
            logprobs, mask, _ = group_logprobs(
                engine.model, prompt, [g.token_ids for g in group], SAMPLING.temperature, engine.tokenizer.pad_token_id
            )
        assert mask.sum(dim=1).tolist() == [len(g.token_ids) for g in group]
        for row, g in enumerate(group):
            # On-policy, the importance ratio is 1: the trainer sees what the sampler sampled from.
            assert torch.allclose(logprobs[row, : len(g.token_ids)], torch.tensor(g.logprobs), atol=1e-4)
            assert g.finish_reason in ("stop", "length")
            assert len(g.token_ids) <= SAMPLING.max_new_tokens
            assert (g.token_ids[-1] == engine.tokenizer.eos_token_id) == (g.finish_reason == "stop")


def test_shared_prompt_logprobs_and_gradients_equal_separate_sequences(engines):
    """The prefix-shared forward must be exactly the per-sequence computation, gradients included."""
    engine, _ = engines
    model, pad = engine.model, engine.tokenizer.pad_token_id
    prompt = engine.encode_chat([{"role": "user", "content": "What is 4 + 4?"}])
    completions = [[65, 66, 67, 258], [68], [69, 70]]  # ragged, one of length 1

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        return out

    model.zero_grad()
    shared, mask, _ = group_logprobs(model, prompt, completions, 0.7, pad)
    (shared * mask).sum().backward()
    shared_grads = grads()
    for row, completion in enumerate(completions):  # the reference: one plain forward per sequence
        ids = torch.tensor([prompt + completion])
        alone = token_logprobs(model(input_ids=ids).logits[:, len(prompt) - 1 : -1], ids[:, len(prompt) :], 0.7)
        assert torch.allclose(alone[0], shared[row, : len(completion)].detach(), atol=1e-5)
        alone.sum().backward()
    separate_grads = grads()
    for name, g in shared_grads.items():
        assert torch.allclose(g, separate_grads[name], atol=1e-4), name
