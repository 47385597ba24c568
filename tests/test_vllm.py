"""The vLLM engine against the transformers one (make test-vllm: vLLM's CPU build in .venv-vllm;
skipped where vLLM is not installed). fp32 on both sides, so they must agree to float error:
greedy tokens identical, keyed noise drawing the same tokens for the same grant, log-probs of the
same sampled tokens within 1e-3 nats (measured here: 5e-7 on the tiny model, 6e-5 on SmolLM2)."""

import pytest
import torch

from echo.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig
from echo.engines import make_engine
from echo.engines.hf import HFEngine
from echo.model.policy import group_logprobs
from echo.trust.noise import Draw, group_key
from echo.trust.proof import ProofSettings, SamplingProof
from echo.weights.shards import WeightsMismatch, weights_shards
from tests.conftest import assert_balanced, read_metrics, run_trainer_and_sampler, tiny_config
from tests.groups import keyed_groups

pytest.importorskip("vllm")
from bench.engines import new_version
from echo.engines.vllm import VLLMEngine, vllm_lora_rank

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-3
SEED = 7  # the run's: the noise's key
PROMPTS = [[{"role": "user", "content": text}] for text in ("What is 2 + 3?", "Name a colour.", "Say hi " * 12)]


def _draws(count: int, first_slot: int = 1) -> list[Draw]:
    return [Draw(group_key(SEED, 0, slot), first=slot % 3, position=slot % 2)
            for slot in range(first_slot, first_slot + count)]


def _version(hf: HFEngine, seed: int) -> list[bytearray]:
    return new_version(hf, seed, scale=0.05)


def _gap(hf: HFEngine, prompt: list[int], generations) -> float:
    """The largest difference between vLLM's log-probs and transformers' for the same tokens."""
    with torch.no_grad():
        recomputed, _, _ = group_logprobs(hf.model, prompt, [g.token_ids for g in generations], hf.temperature,
                                          hf.tokenizer.pad_token_id)
    return max(abs(recomputed[i, j].item() - lp) for i, g in enumerate(generations) for j, lp in enumerate(g.logprobs))


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def engines(request):
    sampling = SamplingConfig(group_size=4, max_new_tokens=16, temperature=0.7)
    lora = LoraConfig(r=8, alpha=16.0)
    engines = HFEngine(request.param, lora, sampling, "cpu", "float32"), VLLMEngine(
        ModelConfig(name=request.param, device="cpu", dtype="float32"), lora, sampling)
    yield engines
    engines[1].llm.llm_engine.engine_core.shutdown()  # now, not at interpreter exit with its logging closed


def test_vllm_and_transformers_agree_for_the_same_adapter(engines):
    """Keyed noise in vLLM: vLLM drew with its own generator, so a keyed run refused it. Its sampler now draws
    through echo/engines/vllm_worker.py's KeyedNoise: the same tokens as transformers for the
    same draws, with the log-probs of softmax(logits / T), and its groups pass the proof."""
    hf, vllm = engines
    shards = _version(hf, seed=1)
    vllm.load_weights(shards)
    prompts = [hf.encode_chat(m) for m in PROMPTS]
    assert [vllm.encode_chat(m) for m in PROMPTS] == prompts
    greedy_hf, greedy_vllm = hf.generate(prompts, 1, greedy=True), vllm.generate(prompts, 1, greedy=True)
    assert [g[0].token_ids for g in greedy_vllm] == [g[0].token_ids for g in greedy_hf]
    keyed_hf = hf.generate(prompts, 4, draws=_draws(len(prompts)))
    keyed_vllm = vllm.generate(prompts, 4, draws=_draws(len(prompts)))
    assert [[g.token_ids for g in group] for group in keyed_vllm] == [[g.token_ids for g in group] for group in keyed_hf]
    for prompt, group in zip(prompts, keyed_vllm):
        assert len(group) == 4
        assert _gap(hf, prompt, group) < TOLERANCE  # tempered log-probs, as the trainer assumes
        for g in group:
            assert g.finish_reason == "length" or g.token_ids[-1] == hf.tokenizer.eos_token_id
    proof = SamplingProof(hf.model, hf.tokenizer.pad_token_id, ProofSettings(
        hf.temperature, 1.0, 0.01, keep=2, noise_seed=SEED))
    proof.remember(0)
    groups = keyed_groups(vllm, [0, 1], SEED, 1, 4, engine="vllm")
    assert [proof.forged(g, proof.check(g)) for g in groups] == [None, None]


def test_a_new_version_is_served_at_once_and_the_old_adapter_is_gone(engines):
    hf, vllm = engines
    prompts = [hf.encode_chat(m) for m in PROMPTS]
    vllm.load_weights(_version(hf, seed=2))
    before = vllm.versions_loaded
    vllm.load_weights(_version(hf, seed=3))  # hf now holds version 3
    assert vllm.versions_loaded == before + 1 and vllm.adapter.lora_name == f"policy-{before + 1}"
    assert set(vllm.llm.llm_engine.list_loras()) == {vllm.adapter.lora_int_id}  # memory stays flat
    for prompt, group in zip(prompts, vllm.generate(prompts, 4, draws=_draws(len(prompts)))):
        assert _gap(hf, prompt, group) < TOLERANCE  # not version 2's adapter, nor its cached prompt


def test_weights_that_do_not_fit_are_refused_and_the_current_ones_kept(engines):
    hf, vllm = engines
    shards = _version(hf, seed=4)
    vllm.load_weights(shards)
    other = HFEngine("tiny", LoraConfig(r=4), SamplingConfig())  # another rank (and, for SmolLM2, another base)
    with pytest.raises(WeightsMismatch):
        vllm.load_weights([bytearray(s) for s in weights_shards(other.model, 2**30)])
    prompt = hf.encode_chat(PROMPTS[0])
    assert _gap(hf, prompt, vllm.generate([prompt], 4, draws=_draws(1))[0]) < TOLERANCE


def test_full_weight_mode_loads_new_weights_in_place():
    """With the engine's own noise too (sampling.noise = "engine": vLLM's sampler and log-probs)."""
    sampling = SamplingConfig(group_size=4, max_new_tokens=16, temperature=0.7, noise="engine")
    lora = LoraConfig(enabled=False)
    hf = HFEngine("tiny", lora, sampling, "cpu", "float32")
    vllm = VLLMEngine(ModelConfig(name="tiny", device="cpu", dtype="float32"), lora, sampling)
    prompt = hf.encode_chat(PROMPTS[0])
    before = vllm.generate([prompt], 1, greedy=True)[0][0].token_ids
    vllm.load_weights(_version(hf, seed=5))  # every parameter moved, the tied embedding among them
    group = vllm.generate([prompt], 4)[0]
    assert _gap(hf, prompt, group) < TOLERANCE
    assert vllm.generate([prompt], 1, greedy=True)[0][0].token_ids == hf.generate([prompt], 1, greedy=True)[0][0].token_ids
    assert hf.generate([prompt], 1, greedy=True)[0][0].token_ids != before


def test_max_lora_rank_is_rounded_up_to_a_size_vllm_serves():
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 12, 16, 17, 320)] == [1, 8, 8, 16, 16, 32, 320]


@pytest.mark.slow
def test_a_vllm_sampler_trains_a_swarm_end_to_end(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, run={"id": "vllm", "steps": 3}, sampler={"engine": "vllm"},
                      trainer={"verify_fraction": 1.0}, nats={"url": nats_server.url})  # keyed noise
    run_trainer_and_sampler(tmp_path, cfg, "v1", timeout=280)  # the trainer finished the run
    metrics = read_metrics(cfg.run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3] and all(m["used"] == 4 for m in metrics)
    proof = metrics[-1]["proof_of_sampling"]  # every group's tokens and log-probs by the trainer's transformers
    assert proof["passed"] >= 12 and "forged" not in proof
    assert {sampler for m in metrics for _, _, sampler in m["groups"]} == {"v1"}
    assert_balanced(metrics)


def test_routing_replay_where_vllm_returns_no_routed_experts_is_refused_at_start_naming_the_field(tmp_path):
    """vLLM returns each token's experts from its V2 model runner only, which its CPU build
    cannot run (no Triton backend for the CPU): a sampler asked to record routing with it stops at
    start in one line, instead of sending groups the trainer would refuse as no_routing."""
    cfg = tiny_config(tmp_path, model={"name": "tiny-moe", "device": "cpu", "dtype": "float32"},
                      algorithm={"router_replay": "replay"}, sampler={"engine": "vllm"})
    with pytest.raises(ConfigError, match=r"router_replay = 'replay' with sampler.engine = 'vllm': this vLLM cannot "
                                          r"return routed experts \(.*Model Runner V2") as refused:
        make_engine(cfg, "s1")
    assert "\n" not in str(refused.value)
