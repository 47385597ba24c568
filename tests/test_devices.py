"""Devices and precision (echo/model/devices.py): what each process resolves, what stays fp32 under a
16-bit model, and weights published in bf16. No GPU here: the 16-bit paths run in bf16 on the CPU."""

import importlib.util

import pytest
import torch

from echo.config import ConfigError
from echo.engines import engine_choice
from echo.engines.hf import HFEngine
from echo.model.devices import autocast, resolve_device, resolve_dtype
from echo.model.loading import load_model
from echo.model.policy import group_logprobs, make_policy
from echo.train.learner import Batch, Forward, Rewarded, make_optimizer, train_step
from echo.trust.proof import ProofSettings, SamplingProof
from echo.weights.shards import load_weights, policy_tensors, weights_shards
from tests.conftest import tiny_config
from tests.groups import honest_group


def test_auto_picks_the_best_device_here_and_its_dtype():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device = resolve_device("auto")
    assert device.type == expected
    if expected == "cpu":
        assert resolve_dtype("auto", device) == torch.float32  # 16-bit matmuls are slower on a CPU
    assert resolve_dtype("auto", torch.device("mps")) == torch.float16
    assert resolve_dtype("bfloat16", device) == torch.bfloat16


def test_auto_engine_is_vllm_only_with_vllm_and_a_gpu():
    expected = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "hf"
    assert engine_choice("auto") == expected and engine_choice("hf") == "hf"


@pytest.mark.parametrize("field, value", [("device", "gpu"), ("device", "cuda:x"), ("dtype", "bf16")])
def test_a_bad_device_or_dtype_fails_at_start_naming_the_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        tiny_config(tmp_path, model={field: value})


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_a_device_this_machine_does_not_have_is_refused_with_what_it_has():
    with pytest.raises(ConfigError, match=r"model.device = 'cuda:7'.*sees \d+ CUDA device"):
        resolve_device("cuda:7")


def _batch():
    groups = [honest_group(12 + i) for i in range(2)]
    return Batch([Rewarded(g, [float(i % 2) for i in range(len(g.completions))]) for g in groups])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-weight"])
def test_a_bf16_trainer_trains_fp32_parameters_with_fp32_optimizer_state_and_log_probs(tmp_path, lora):
    """LoRA: the frozen base is bf16, the adapter fp32. Full weights: the model stays fp32 (the
    master copy) and the forward runs under bf16 autocast. Either way the step moves the trained
    parameters, and the loss's log-probs are fp32."""
    cfg = tiny_config(tmp_path, lora={"enabled": lora})
    base, tokenizer = load_model("tiny", "cpu", torch.bfloat16 if lora else torch.float32)
    policy = make_policy(base, cfg.lora)
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    if lora:
        assert policy.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
        with torch.no_grad():
            for p in trained:
                p.normal_(0, 0.05)  # a non-zero adapter: every tensor gets a gradient
    before = [p.detach().clone() for p in trained]
    optimizer = make_optimizer(policy, cfg)
    stats = train_step(Forward.of(policy, cfg, tokenizer.pad_token_id, torch.bfloat16), optimizer, _batch())
    assert stats["grad_norm"] > 0 and all(not torch.equal(a, p) for a, p in zip(before, trained))
    states = [s for s in optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    group = honest_group(12)
    with torch.no_grad(), autocast(torch.device("cpu"), torch.bfloat16):
        logprobs, _, _ = group_logprobs(policy, group.prompt_token_ids, [c.token_ids for c in group.completions],
                                        1.0, tokenizer.pad_token_id)
    assert logprobs.dtype == torch.float32


def test_weights_published_in_bf16_halve_the_bytes_and_load_into_an_engine_of_any_dtype(tmp_path):
    cfg = tiny_config(tmp_path, sampling={"dtypes": ["float32", "bfloat16"]})
    trainer = make_policy(load_model("tiny")[0], cfg.lora)
    with torch.no_grad():
        for p in trainer.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    full, half = (list(weights_shards(trainer, 2**30, dtype)) for dtype in (None, torch.bfloat16))
    def payload(shard: bytes) -> int:  # the tensors' bytes, after the JSON header
        return len(shard) - 8 - int.from_bytes(shard[:8], "little")

    assert payload(half[0]) * 2 == payload(full[0])
    rounded = policy_tensors(trainer, torch.bfloat16)
    for dtype in ("float32", "bfloat16"):
        engine = HFEngine("tiny", cfg.lora, cfg.sampling, "cpu", dtype)
        load_weights(engine.model, [bytearray(s) for s in half])
        # The adapter stays fp32 (peft's choice over a 16-bit base too) and holds the bf16 values exactly.
        assert all(torch.equal(v.float(), rounded[k].float()) for k, v in policy_tensors(engine.model).items())
        assert engine.generate([engine.encode_chat([{"role": "user", "content": "hi"}])], 2)[0][0].token_ids


def test_the_proof_checks_against_the_rounded_weights_samplers_run_and_keeps_the_trainers_own(tmp_path):
    """With bf16 publishing, the samplers run the rounded adapter: the proof recomputes with that
    one, and afterwards the trainer's unrounded fp32 adapter is back in place, bit for bit."""
    cfg = tiny_config(tmp_path)
    engine = HFEngine("tiny", cfg.lora, cfg.sampling, "cpu", "float32")
    trainer = make_policy(load_model("tiny")[0], cfg.lora)
    with torch.no_grad():
        for p in trainer.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    live = {k: v.clone() for k, v in policy_tensors(trainer).items()}
    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id,
                          ProofSettings(cfg.sampling.temperature, 1.0, 1e-4, keep=2, publish_dtype=torch.bfloat16))
    proof.remember(0)
    load_weights(engine.model, [bytearray(s) for s in weights_shards(trainer, 2**30, torch.bfloat16)])
    prompt = engine.encode_chat([{"role": "user", "content": "2+2?"}])
    group = honest_group(12, version=0, prompt_token_ids=prompt)
    completions = engine.generate([prompt], 4)[0]
    group = group.model_copy(update={"completions": [
        c.replaced(token_ids=g.token_ids, logprobs=g.logprobs)
        for c, g in zip([group.completions[0]] * 4, completions)]})
    checked = proof.check(group)
    assert checked.gap < 1e-4 and not proof.forged(group, checked)  # exact: same rounded weights, same dtype
    assert all(torch.equal(v, live[k]) for k, v in policy_tensors(trainer).items())
