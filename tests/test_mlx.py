"""The MLX engine (issue 81, `sampler.engine = "mlx"`), on MLX's CPU backend: its logits are the
trainer's under the same weights, every version swapped in place; its keyed draws are the ones
the trainer draws again (the proof passes them, and strikes a forged token); partial rollouts
change versions between chunks; what it cannot take is refused at start or at load."""

import time

import numpy as np
import pytest
import safetensors.torch
import torch

from echo.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig
from echo.engines.hf import HFEngine
from echo.noise import Draw, group_key
from echo.policy import WeightsMismatch, group_logprobs, load_weights, tensors_from_buffer, weights_shards
from echo.proof import ProofSettings, SamplingProof
from echo.wire.names import Version
from tests.conftest import tiny_config
from tests.groups import TASK, honest_group, keyed_groups, perturb
from tests.swarms import assert_every_group_proved, run_swarm
from workers.sampler.generation import generate_groups
from workers.sampler.ranks import WATCH_S, start_ranks

mx = pytest.importorskip("mlx.core")
from echo.engines.mlx import MLXEngine  # noqa: E402  (needs mlx)

LORA = LoraConfig(r=4, alpha=8.0)
SAMPLING = SamplingConfig(group_size=8, max_new_tokens=24, temperature=1.0)
SEED = 7


def _versions(model_name: str, lora: LoraConfig, count: int):
    """A trainer-side policy and `count` versions of it as published (each moved on from the last)."""
    policy = HFEngine(model_name, lora, SAMPLING, "cpu", "float32").model
    versions = []
    for version in range(count):
        perturb(policy, seed=version)
        versions.append([bytearray(s) for s in weights_shards(policy, 2**30)])
    return policy, versions


def _model(name: str, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(name=name, device="cpu", dtype=dtype)


def _logits(engine: MLXEngine, ids: list[int]) -> np.ndarray:
    return np.array(engine.model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("model_name, lora", [("tiny", LORA), ("tiny", LoraConfig(enabled=False)), ("smollm2", LORA)],
                         ids=["tiny-lora", "tiny-full-weight", "smollm2-lora"])
def test_each_version_swapped_in_place_gives_the_trainers_logits_and_a_mismatch_keeps_the_old(model_name, lora):
    policy, versions = _versions(model_name, lora, 2)
    engine = MLXEngine(_model(model_name), lora, SAMPLING)
    ids = engine.encode_chat(TASK.prompt(3).messages)
    for shards in (versions[0], versions[1]):
        load_weights(policy, shards)
        engine.load_weights(shards)
        with torch.no_grad():
            want = policy(input_ids=torch.tensor([ids])).logits[0].numpy()
        # fp32: float error only (SmolLM2's 30 layers: 2e-4 in logits of ~30), far inside the proof's 0.01
        assert np.abs(_logits(engine, ids) - want).max() < 1e-3
    before = _logits(engine, ids)
    first = tensors_from_buffer(versions[0][0])
    wrong = {**first, next(iter(first)): torch.zeros(3, 3)}  # a shape the model does not have
    with pytest.raises(WeightsMismatch):
        engine.load_weights([bytearray(safetensors.torch.save({k: v.contiguous() for k, v in wrong.items()}))])
    assert np.array_equal(_logits(engine, ids), before)


def test_its_keyed_draws_are_hfs_and_pass_the_proof_and_a_forged_token_is_struck():
    """The same adapter in the hf and mlx engines: the same completions for the same keys (fp32),
    each group passes the trainer's token and log-prob check, and a token swapped with its true
    log-probs is a token forgery."""
    policy, versions = _versions("tiny", LORA, 1)
    hf, engine = HFEngine("tiny", LORA, SAMPLING, "cpu", "float32"), MLXEngine(_model("tiny"), LORA, SAMPLING)
    hf.load_weights(versions[0])
    engine.load_weights(versions[0])
    mine, theirs = keyed_groups(engine, [1, 2, 3, 4], SEED, 0, 8), keyed_groups(hf, [1, 2, 3, 4], SEED, 0, 8)
    assert [[c.token_ids.tolist() for c in g.completions] for g in mine] == \
        [[c.token_ids.tolist() for c in g.completions] for g in theirs]
    proof = SamplingProof(policy, 0, ProofSettings(SAMPLING.temperature, 1.0, 0.01, keep=2, noise_seed=SEED))
    proof.remember(0)
    for group in mine:
        checked = proof.check(group.replaced(engine="mlx"))
        assert checked.gap < 1e-4 and checked.margin < 1e-4 and proof.forged(group, checked) is None
    first = mine[0].completions[0]
    swapped = [*first.token_ids[:2].tolist(), int(first.token_ids[2] + 1) % 256, *first.token_ids[3:].tolist()]
    with torch.no_grad():
        logprobs = group_logprobs(policy, mine[0].prompt_token_ids, [swapped], 1.0, 0)[0][0, : len(swapped)].tolist()
    forged = mine[0].replaced(completions=[first.replaced(token_ids=swapped, logprobs=logprobs),
                                           *mine[0].completions[1:]])
    assert proof.forged(forged, proof.check(forged)) == "token_forgery"


def test_a_partial_rollout_changes_versions_between_chunks_and_passes_the_proof():
    sampling = SAMPLING.model_copy(update={"chunk_tokens": 8})
    policy, versions = _versions("tiny", LORA, 2)
    engine = MLXEngine(_model("tiny"), LORA, sampling)
    engine.load_weights(versions[0])
    proof = SamplingProof(policy, 0, ProofSettings(sampling.temperature, 1.0, 0.01, keep=3, noise_seed=SEED))
    for version, shards in enumerate(versions):
        load_weights(policy, shards)
        proof.remember(version)

    class OneSwap:
        swapped = False

        def between_chunks(self):
            if self.swapped:
                return None
            self.swapped = True
            engine.load_weights(versions[1])
            return 1

    ids = engine.encode_chat(TASK.prompt(5).messages)
    gens = engine.generate([ids], 8, newer_weights=OneSwap(), draws=[Draw(group_key(SEED, 0, 1))])[0]
    assert any(g.version_changes == ((8, 1),) for g in gens)
    group = honest_group(5, version=0, prompt_token_ids=ids, version_changes=[{"at": 8, "version": 1}],
                         completions=[honest_group().completions[0].replaced(token_ids=g.token_ids, logprobs=g.logprobs)
                                      for g in gens])
    checked = proof.check(group)
    assert checked.gap < 1e-4 and checked.margin < 1e-4


def test_a_mixture_of_experts_routing_is_recorded_as_the_trainer_replays_it():
    """tiny-moe (Qwen3-MoE) with its attention adapted: the experts mlx-lm's blocks chose for
    every prompt and completion token travel with the group, and the trainer's proof, replaying
    them, finds the group's log-probs and tokens its own; made-up experts are forged_routing."""
    lora = LoraConfig(r=4, alpha=8.0, target_parameters=[])
    policy, versions = _versions("tiny-moe", lora, 1)
    engine = MLXEngine(_model("tiny-moe"), lora, SAMPLING, record_routing=True)
    engine.load_weights(versions[0])
    assert engine.routing == (2, 2, 8)
    groups = generate_groups(engine, TASK, [TASK.prompt(1), TASK.prompt(2)], SAMPLING, "s1", Version(0, 0), [1, 2],
                             keys=[group_key(SEED, 0, 1), group_key(SEED, 0, 2)])
    proof = SamplingProof(policy, 0, ProofSettings(SAMPLING.temperature, 1.0, 0.01, keep=2, noise_seed=SEED,
                                                   routing_margin=0.05))
    proof.remember(0)
    checks = proof.check_many(groups)
    for group in groups:
        assert len(group.routing.ids) == len(group.prompt_token_ids) + sum(len(c.token_ids) for c in group.completions)
        checked = checks[group.group_id]
        assert checked.gap < 1e-4 and checked.margin < 1e-4 and checked.routing < 1e-4, checked
    ids = groups[0].routing.ids.copy()
    ids[: len(groups[0].prompt_token_ids)] = (ids[: len(groups[0].prompt_token_ids)] + 3) % 8  # other experts
    forged = groups[0].replaced(routing=groups[0].routing.model_copy(update={"ids": ids}))
    assert proof.forged(forged, proof.check(forged)) in ("forged_routing", "logprob_forgery", "token_forgery")


def test_building_it_leaves_the_processs_open_file_limits_as_they_were():
    """mlx-lm sets them to (2048, 4096) on import, the hard limit included: a page test holding
    2,000 sockets failed in the test process after an MLX test."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    MLXEngine(_model("tiny"), LORA, SAMPLING)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before


def test_what_it_cannot_take_is_refused_at_start_in_one_line():
    with pytest.raises(ConfigError, match="dense model"):
        MLXEngine(_model("tiny"), LORA, SAMPLING, record_routing=True)
    with pytest.raises(ConfigError, match="do not map onto mlx-lm"):  # LoRA on the experts' stacked weights
        MLXEngine(_model("tiny-moe"), LORA, SAMPLING)
    with pytest.raises(ConfigError, match="sampling.dtypes"):
        MLXEngine(_model("tiny", "bfloat16"), LORA, SAMPLING)


@pytest.mark.parametrize("model, overrides", [
    ("tiny", ()),
    ("tiny-moe", ('algorithm.router_replay="replay"', "lora.target_parameters=[]")),
], ids=["dense", "moe-replay"])
def test_mlx_samplers_train_an_async_swarm_every_group_proved(tmp_path, model, overrides):
    """`echo-rl up` with sampler.engine = "mlx": both samplers draw with MLX, the trainer proves
    every group (the default verify_fraction 1) and trains on them; on the mixture of experts
    every group carries the routing the trainer replays."""
    metrics, stream, _ = run_swarm(tmp_path, "mlx", 3, 'sampler.engine="mlx"', "trainer.max_staleness=1", *overrides,
                                   model=model)
    assert_every_group_proved(metrics)
    assert stream and {r["group"]["engine"] for r in stream} == {"mlx"}
    assert all((r["group"]["routing"] is not None) == (model == "tiny-moe") for r in stream)


def test_one_model_over_two_ranks_draws_what_it_draws_whole_and_a_lost_rank_is_noticed(tmp_path):
    """sampler.ranks = 2 on this box: rank 1 started here (workers/sampler/ranks.py), mlx-lm's
    pipeline giving each rank half the layers. Versions and calls go from rank 0 to rank 1; the
    split model's keyed draws and log-probs are the whole model's, a version swapped in between
    chunks included. Rank 1 killed: noticed within RankWatch's bound."""
    cfg = tiny_config(tmp_path, lora={"r": LORA.r, "alpha": LORA.alpha},
                      sampling={**SAMPLING.model_dump(), "chunk_tokens": 8}, sampler={"engine": "mlx", "ranks": 2})
    _, versions = _versions("tiny", LORA, 2)
    lost = []
    group, watch = start_ranks(cfg, on_lost=lambda rank, code: lost.append(rank))
    split = MLXEngine(_model("tiny"), LORA, cfg.sampling, group=group)
    whole = MLXEngine(_model("tiny"), LORA, cfg.sampling)
    assert split.model.model.end_idx - split.model.model.start_idx == 1  # its half of the tiny model's 2 layers

    class OneSwap:  # each engine's weights room: version 1 after the first chunk
        def __init__(self, engine):
            self.engine, self.swapped = engine, False

        def between_chunks(self):
            if self.swapped:
                return None
            self.swapped = True
            self.engine.load_weights(versions[1])
            return 1

    ids = [whole.encode_chat(TASK.prompt(i).messages) for i in (1, 2)]
    draws = [Draw(group_key(SEED, 0, slot)) for slot in (1, 2)]
    got = {}
    for name, engine in (("split", split), ("whole", whole)):
        engine.load_weights(versions[0])
        got[name] = engine.generate(ids, 8, newer_weights=OneSwap(engine), draws=draws)
    tokens = {name: [[g.token_ids for g in gens] for gens in out] for name, out in got.items()}
    assert tokens["split"] == tokens["whole"]
    assert max(abs(a - b) for x, y in zip(got["split"], got["whole"]) for g, h in zip(x, y)
               for a, b in zip(g.logprobs, h.logprobs)) < 1e-5
    assert any(g.version_changes for gens in got["split"] for g in gens)
    started = time.perf_counter()
    watch.processes[0].kill()
    while not lost and time.perf_counter() - started < 10 * WATCH_S:
        time.sleep(0.02)
    assert lost == [1] and time.perf_counter() - started < 2 * WATCH_S + 0.5


def test_a_split_mlx_sampler_trains_a_swarm_every_group_proved(tmp_path):
    """`echo-rl up` with sampler.ranks = 2: each sampler starts its second rank itself, and the
    trainer proves every group."""
    metrics, stream, stderr = run_swarm(tmp_path, "mlx-split", 3, 'sampler.engine="mlx"', "sampler.ranks=2")
    assert_every_group_proved(metrics)
    assert stream and {r["group"]["engine"] for r in stream} == {"mlx"} and "sampler.ranks" in stderr

