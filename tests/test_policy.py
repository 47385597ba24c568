"""The policy on the tiny model: published weights (LoRA or full) move between model instances
exactly, and the engine's behaviour log-probs are what the trainer computes for the same tokens."""

import contextlib
import copy
import hashlib
import tracemalloc
import types

import pytest
import safetensors.torch
import torch

import echo.model.loading
import echo.model.policy
import echo.weights.digest
from echo.config import LoraConfig, SamplingConfig
from echo.engines.base import call_seed
from echo.engines.hf import HFEngine, PagedEngine
from echo.model.loading import base_model_digest, load_model
from echo.model.policy import group_logprobs, make_policy, packed_logprobs
from echo.train.algorithms import grpo
from echo.train.algorithms.grpo import token_logprobs
from echo.weights.shards import WeightsMismatch, tensors_from_buffer, weights_shards

SAMPLING = SamplingConfig(group_size=4, max_new_tokens=12, temperature=0.7)


@pytest.fixture(scope="module")
def engines():
    return HFEngine("tiny", LoraConfig(r=4), SAMPLING), HFEngine("tiny", LoraConfig(r=4), SAMPLING)


def shards_of(model, shard_bytes: int = 2**30) -> list[bytearray]:
    return [bytearray(s) for s in weights_shards(model, shard_bytes)]


def same_logits(a: HFEngine, b: HFEngine) -> bool:
    ids = torch.tensor([a.encode_chat([{"role": "user", "content": "What is 1 + 1?"}])])
    with torch.no_grad():
        return torch.equal(a.model(input_ids=ids).logits, b.model(input_ids=ids).logits)


def test_tiny_base_model_is_the_same_in_every_process():
    a, _ = load_model("tiny")
    b, _ = load_model("tiny")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_base_model_is_known_by_its_weights_wherever_its_copy_lies(tmp_path, monkeypatch):
    """An edge sampler's copy of the model sits at another path than the trainer's: the weights
    decide whether published adapters fit it, not the path (they did, and a copy never matched)."""
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    model, tokenizer = load_model("tiny")
    for folder in ("trainer-box", "edge-box"):
        model.save_pretrained(tmp_path / folder)
        tokenizer.save_pretrained(tmp_path / folder)
    digest = base_model_digest(str(tmp_path / "trainer-box"))
    assert digest == base_model_digest(str(tmp_path / "edge-box")) == base_model_digest("tiny")
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    model.save_pretrained(tmp_path / "fine-tuned")
    assert base_model_digest(str(tmp_path / "fine-tuned")) != digest
    assert (tmp_path / "cache" / "digests.json").exists()  # a folder is read once per machine


def test_a_sharded_base_is_known_by_the_same_digest_read_a_piece_at_a_time(tmp_path, monkeypatch):
    """A hub checkpoint comes in shards (Qwen3-30B-A3B: 16 files, 61 GB): the digest is the
    tensors' (name, dtype, shape, bytes in name order) as hashing the loaded tensors gives it,
    whatever the sharding, and reads the files a piece at a time instead of holding the model."""
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    model, _ = load_model("tiny-moe")
    model.save_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 3
    tensors = {}
    for f in shards:
        tensors |= safetensors.torch.load_file(f)
    reference = hashlib.sha256()  # the loaded tensors hashed, as the digest was first computed
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        reference.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode() + t.view(torch.uint8).numpy().tobytes())
    assert base_model_digest(str(tmp_path / "sharded")) == "sha256:" + reference.hexdigest()
    assert base_model_digest(str(tmp_path / "sharded")) == base_model_digest(str(tmp_path / "whole"))
    big = tmp_path / "big"  # 96 MB in tensors of mixed dtypes, an empty one and a scalar (a view as bytes failed on it)
    big.mkdir()
    (big / "config.json").write_text("{}")  # a model folder, as far as finding its weights goes
    safetensors.torch.save_file({"a": torch.zeros(4096, 2048), "b": torch.ones(4096, 2048, dtype=torch.bfloat16),
                                 "s": torch.tensor(3)}, big / "model-1.safetensors")
    safetensors.torch.save_file({"c": torch.full((8192, 2048), 2.0), "d": torch.zeros(2, 0)}, big / "model-2.safetensors")
    tracemalloc.start()
    try:
        base_model_digest(str(big))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * echo.weights.digest.READ + 2**20, peak  # one piece read (and hashed) at a time


def test_adapter_moves_between_instances_and_reproduces_logits(engines):
    source, target = engines
    with torch.no_grad():
        for name, p in source.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    target.load_weights(shards_of(source.model))
    assert same_logits(source, target)


def test_a_mixture_of_experts_takes_lora_on_attention_and_experts_and_samples_what_the_trainer_computes():
    """tiny-moe (Qwen3-MoE, 8 experts, top-2): the adapter wraps the attention layers and each
    layer's stacked experts (peft's target_parameters); it moves to a sampler's instance whole,
    and the sampler's log-probs are the trainer's (in fp32 both route alike)."""
    source, target = (HFEngine("tiny-moe", LoraConfig(r=4), SAMPLING) for _ in range(2))
    adapted = {n.split(".lora_")[0] for n, _ in source.model.named_parameters() if ".lora_A." in n}
    assert {n.rsplit(".", 1)[-1] for n in adapted} >= {"q_proj", "k_proj", "v_proj", "o_proj", "experts", "base_layer"}
    with torch.no_grad():
        for name, p in source.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    assert not same_logits(source, target)
    target.load_weights(shards_of(source.model))
    assert same_logits(source, target)
    prompt = target.encode_chat([{"role": "user", "content": "What is 2 + 3?"}])
    group = target.generate([prompt], 4)[0]
    with torch.no_grad():
        logprobs, _, _ = group_logprobs(source.model, prompt, [g.token_ids for g in group], SAMPLING.temperature,
                                        source.tokenizer.pad_token_id)
    for row, g in enumerate(group):
        assert torch.allclose(logprobs[row, : len(g.token_ids)], torch.tensor(g.logprobs), atol=1e-4)
    dense = make_policy(load_model("tiny")[0], LoraConfig(r=4))
    assert not dense.peft_config["default"].target_parameters  # a dense model has no stacked experts


def test_full_weights_move_in_shards_and_reproduce_logits():
    source, target = (HFEngine("tiny", LoraConfig(enabled=False), SAMPLING) for _ in range(2))
    with torch.no_grad():
        for p in source.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert not same_logits(source, target)
    shards = shards_of(source.model, shard_bytes=2**16)
    assert len(shards) > 3  # the tiny model is ~0.36 MB in float32
    target.load_weights(shards)
    assert same_logits(source, target)


def test_tensors_from_buffer_are_views_of_it_and_equal_safetensors_own_load():
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    buffer = bytearray(safetensors.torch.save(tensors))
    parsed = tensors_from_buffer(buffer)
    reference = safetensors.torch.load(bytes(buffer))
    assert parsed.keys() == reference.keys() and all(torch.equal(parsed[k], reference[k]) for k in parsed)
    data_start = 8 + int.from_bytes(buffer[:8], "little")
    buffer[data_start:] = bytes(len(buffer) - data_start)  # zero the data in place
    assert all(not t.any() for t in parsed.values())


def _safetensors_with_header(header: bytes, data_bytes: int) -> bytearray:
    return bytearray(len(header).to_bytes(8, "little") + header + bytes(data_bytes))


MALFORMED_HEADERS = {  # each once crashed the sampler (RuntimeError, AttributeError, TypeError) instead of a refusal
    "shape-not-sizes": b'{"x":{"dtype":"F32","shape":"four","data_offsets":[0,16]}}',
    "negative-shape": b'{"x":{"dtype":"F32","shape":[-1,-4],"data_offsets":[0,16]}}',
    "header-a-list": b'[{"dtype":"F32","shape":[4],"data_offsets":[0,16]}]',
    "offsets-not-ints": b'{"x":{"dtype":"F32","shape":[4],"data_offsets":["0",16]}}',
    "fractional-shape": b'{"x":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}}',
}


@pytest.mark.parametrize("kind", ["garbage", "other-rank", "full-into-lora", "bad-offsets", *MALFORMED_HEADERS])
def test_mismatched_weights_are_refused_and_the_old_ones_kept(engines, kind):
    _, target = engines
    before = list(weights_shards(target.model, 2**30))
    if kind == "garbage":
        shards = [bytearray(b"garbage")]
    elif kind == "other-rank":
        shards = shards_of(make_policy(load_model("tiny")[0], LoraConfig(r=8)))
    elif kind == "full-into-lora":
        shards = shards_of(load_model("tiny")[0])
    elif kind == "bad-offsets":  # a header that promises more bytes than the file holds
        shards = [bytearray(safetensors.torch.save({"x": torch.zeros(4)})[:-8])]
    else:
        shards = [_safetensors_with_header(MALFORMED_HEADERS[kind], 16)]
    with pytest.raises(WeightsMismatch):
        target.load_weights(shards)
    assert list(weights_shards(target.model, 2**30)) == before


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


def test_a_model_folders_generation_defaults_do_not_change_what_is_sampled(tmp_path):
    """transformers fills the fields a generation config leaves unset from the model's own: a
    folder suppressing every token but one would have made every sample that token, while the
    behaviour log-probs, computed from the raw logits, said otherwise."""
    model, tokenizer = load_model("tiny")
    keep = tokenizer.convert_tokens_to_ids("x")
    model.generation_config.suppress_tokens = [t for t in range(len(tokenizer)) if t != keep]
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), LoraConfig(r=4), SAMPLING)
    [group] = engine.generate([engine.encode_chat([{"role": "user", "content": "Hi"}])], 4)
    assert {t for g in group for t in g.token_ids} != {keep}


@pytest.mark.parametrize("questions, owners", [
    (["What is 4 + 4?"], [0, 0, 0]),  # one group
    (["What is 4 + 4?", "Add 123 and 4567, then say why."], [0, 1, 0]),  # two; the shorter is padded
], ids=["one-prompt", "packed-prompts"])
def test_shared_prompt_logprobs_and_gradients_equal_separate_sequences(engines, monkeypatch, questions, owners):
    """The prefix-shared forward (prompts left-padded to the longest, each completion on its own
    prompt's cache) must be exactly the per-sequence computation, gradients included."""
    engine, _ = engines
    model, pad = engine.model, engine.tokenizer.pad_token_id
    with torch.no_grad():  # lora_B non-zero whatever ran before: else every lora_A gradient is zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
    completions = [[65, 66, 67, 258], [68], [69, 70]]  # ragged, one of length 1

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        return out

    with in_float64(model, monkeypatch):
        model.zero_grad()
        shared, mask, _ = packed_logprobs(model, prompts, completions, owners, 0.7, pad)
        (shared * mask).sum().backward()
        shared_grads = grads()
        for row, completion in enumerate(completions):  # the reference: one plain forward per sequence
            prompt = prompts[owners[row]]
            ids = torch.tensor([prompt + completion])
            alone = token_logprobs(model(input_ids=ids).logits[:, len(prompt) - 1 : -1], ids[:, len(prompt) :], 0.7)
            assert torch.allclose(alone[0], shared[row, : len(completion)].detach(), rtol=0, atol=1e-12)
            alone.sum().backward()
        separate_grads = grads()
    assert any(g.abs().sum() > 0 for name, g in shared_grads.items() if "lora_A" in name)
    for name, g in shared_grads.items():
        assert torch.allclose(g, separate_grads[name], rtol=0, atol=1e-12), name


@pytest.mark.parametrize("plain", [True, False], ids=["head-in-chunks", "model-logits"])
def test_log_probs_taken_a_few_positions_at_a_time_are_the_whole_logits_log_softmax(engines, monkeypatch, plain):
    """A plain head's log-probs come from the decoder's hidden states a chunk of positions at a
    time (the head never sees more at once; a chunk's logits are made again in the backward), any
    other head's from the model's logits: both are log-softmax of every position's logits over
    the vocabulary, in value, entropy and gradient."""
    engine, _ = engines
    model, pad, head = engine.model, engine.tokenizer.pad_token_id, engine.model.get_output_embeddings()
    monkeypatch.setattr(grpo, "HEAD_CHUNK_ELEMENTS", head.weight.shape[0] * 5)  # 5 positions: cuts mid-completion
    if not plain:
        monkeypatch.setattr(echo.model.policy, "PLAIN_HEADS", frozenset())
    with torch.no_grad():  # lora_B non-zero: else every lora_A gradient is zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    with in_float64(model, monkeypatch):
        check_log_probs_in_chunks(engine, model, pad, head, plain)


@contextlib.contextmanager
def in_float64(model, monkeypatch):
    """The model in float64 (and back: float32 survives the round trip), RMSNorm too (it computes
    in float32 whatever its input). A packed pass and the one-by-one passes it is checked against
    add in different orders, and a prompt shared by two completions takes their gradients' sum
    through RMSNorm at once where the one-by-one passes take each: in float32 the gradients (up
    to ~5) differed by 2e-4 on the CI's CPU, in float64 with RMSNorm's float32 by 1.5e-6 (both
    2026-12-07), all in float64 by 4e-15. The comparison is of the maths, not of a CPU's rounding."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            monkeypatch.setattr(module, "forward", types.MethodType(rms_norm_in_its_input_dtype, module))
    dtype = next(model.parameters()).dtype
    model.double()
    try:
        yield
    finally:
        model.to(dtype)


def rms_norm_in_its_input_dtype(self, hidden):
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def check_log_probs_in_chunks(engine, model, pad, head, plain):
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in ("What is 4 + 4?", "Add 12 and 30.")]
    completions, owners = [[65, 66, 67, 258, 70, 71], [68], [69, 70, 72, 73]], [0, 1, 0]
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    try:
        model.zero_grad()
        logprobs, mask, entropy = packed_logprobs(model, prompts, completions, owners, 0.7, pad)
        (logprobs * mask).sum().backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    for row, completion in enumerate(completions):
        prompt = prompts[owners[row]]
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7, dim=-1)
        chosen = logp.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert torch.allclose(logprobs[row, : len(completion)].detach(), chosen.detach(), rtol=0, atol=1e-9)
        assert torch.allclose(entropy[row, : len(completion)], -(logp.exp() * logp).sum(-1).detach(), rtol=0, atol=1e-9)
        chosen.sum().backward()
    assert any(g.abs().sum() > 0 for name, g in grads.items() if "lora_A" in name)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(grads[name], p.grad, rtol=0, atol=1e-12), name
    model.zero_grad()
    if plain:  # the head saw 5 positions at most, and every position in some chunk
        assert max(seen) <= 5 and sum(seen) >= 2 * 3 * 6
    else:
        assert max(seen) == 3 * 5  # the whole completion call's logits at once (its inputs: all but the last token)


def test_the_engine_keeps_one_steps_logits_and_its_log_probs_are_those_of_every_steps(engines):
    """The engine's behaviour log-probs, computed one step at a time (SampledLogprobs), are exactly
    what the same draw's every-step logits (generate's output_logits, ~51 GB for 16 x 16k tokens
    over a 49k vocabulary) give: log-softmax(logits / T) at each sampled token."""
    engine, _ = engines
    prompts = [engine.encode_chat([{"role": "user", "content": f"What is {i} + {i}?"}]) for i in range(2)]
    torch.manual_seed(7)
    generations = engine.generate(prompts, n=3)
    batch = engine.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    config = copy.deepcopy(engine.generation_config)
    config.num_return_sequences, config.output_logits = 3, True
    torch.manual_seed(7)
    with torch.no_grad():
        out = engine.model.generate(**batch, generation_config=config)
    new_tokens = out.sequences[:, batch["input_ids"].shape[1]:]
    steps = torch.stack(out.logits, dim=1).float() / SAMPLING.temperature
    every_step = torch.log_softmax(steps, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    for row, g in enumerate(g for per_prompt in generations for g in per_prompt):
        assert g.token_ids == new_tokens[row, :len(g.token_ids)].tolist()  # the same draw
        assert g.logprobs == every_step[row, :len(g.token_ids)].tolist()  # bit for bit


def test_a_calls_sampling_noise_comes_from_the_runs_seed(engines):
    """Each process seeded its sampling at random: no run was reproducible from its config. A
    call's seed (call_seed: run seed, sampler, trainer term, first slot) draws the same
    completions in another engine, and another slot's, term's, sampler's or run's draws others."""
    a, b = engines
    b.load_weights(shards_of(a.model))  # the same weights in both
    prompts = [a.encode_chat([{"role": "user", "content": text}]) for text in ("What is 2 + 3?", "Hi")]

    def tokens(engine, seed):
        return [[g.token_ids for g in group] for group in engine.generate(prompts, 4, seed=seed)]

    first = tokens(a, call_seed(0, "s1", 1, 1))
    assert tokens(b, call_seed(0, "s1", 1, 1)) == first
    others = (call_seed(0, "s1", 1, 2), call_seed(0, "s1", 2, 1), call_seed(0, "s2", 1, 1), call_seed(1, "s1", 1, 1))
    assert len({str(tokens(a, seed)) for seed in others} | {str(first)}) == 5


def test_the_paged_engine_samples_what_the_trainer_computes_and_follows_a_new_version():
    """transformers' continuous batching (sampler.engine = "hf-paged"): its behaviour log-probs
    are the trainer's (importance ratio 1), its noise comes from the call's seed, and after a
    swap of weights it samples from the new version (its cache is the call's own)."""
    engine = PagedEngine("tiny", LoraConfig(r=4), SAMPLING)
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in ("What is 2 + 3?", "Hi")]
    for swap in range(2):
        with torch.no_grad():  # a new, non-trivial adapter: a version the sampler swaps in
            for name, p in engine.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(swap))
        groups = engine.generate(prompts, 4, seed=call_seed(0, "s1", 1, 1 + swap))
        assert [len(g) for g in groups] == [4, 4]
        for prompt, group in zip(prompts, groups):
            with torch.no_grad():
                logprobs, _, _ = group_logprobs(engine.model, prompt, [g.token_ids for g in group],
                                                SAMPLING.temperature, engine.tokenizer.pad_token_id)
            for row, g in enumerate(group):
                assert torch.allclose(logprobs[row, : len(g.token_ids)], torch.tensor(g.logprobs), atol=1e-4)
                assert len(g.token_ids) <= SAMPLING.max_new_tokens
                assert (g.token_ids[-1] == engine.tokenizer.eos_token_id) == (g.finish_reason == "stop")
    again = engine.generate(prompts, 4, seed=call_seed(0, "s1", 1, 2))
    assert [[g.token_ids for g in group] for group in again] == [[g.token_ids for g in group] for group in groups]
    other = engine.generate(prompts, 4, seed=call_seed(0, "s1", 1, 3))
    assert [[g.token_ids for g in group] for group in other] != [[g.token_ids for g in group] for group in groups]
