"""The MLX engine (`sampler.engine = "mlx"`), on MLX's CPU backend: its logits are the
trainer's under the same weights, every version swapped in place; its keyed draws are the ones
the trainer draws again (the proof passes them, and strikes a forged token); partial rollouts
change versions between chunks; what it cannot take is refused at start or at load."""

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import psutil
import pytest
import safetensors.torch
import torch

from echo.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig, load_config
from echo.engines.hf import HFEngine
from echo.model.loading import base_model_digest
from echo.model.policy import group_logprobs
from echo.trust.noise import Draw, group_key
from echo.trust.proof import ProofSettings, SamplingProof
from echo.weights.shards import WeightsMismatch, load_weights, tensors_from_buffer, weights_shards
from echo.wire.messages import GrantRequest, SamplerStatus, Strikes
from echo.wire.names import Version
from streams.client import open_run
from streams.grants import request_grant
from streams.quarantine import read_strikes
from streams.registry import read_statuses
from streams.rollouts import publish_rollout
from streams.server import free_port
from streams.weights import WeightsFollower
from tests.conftest import eventually, eventually_async, stopped, tiny_config
from tests.groups import TASK, honest_group, keyed_groups, perturb
from tests.swarms import assert_every_group_proved, run_swarm
from workers.sampler.generation import generate_groups
from workers.sampler.ranks import start_ranks

mx = pytest.importorskip("mlx.core")
from echo.engines.mlx import MLXEngine, layer_split  # noqa: E402  (needs mlx)

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
    sixteen_bits = SAMPLING.model_copy(update={"dtypes": ["float32", "bfloat16"]})
    with pytest.raises(ConfigError, match="GatherMM"):  # MLX's CPU backend: "Currently only supports float32"
        MLXEngine(_model("tiny-moe", "bfloat16"), LORA.model_copy(update={"target_parameters": []}), sixteen_bits)


@pytest.mark.parametrize("model, overrides", [
    ("tiny", ()),
    ("tiny-moe", ('algorithm.router_replay="replay"', "lora.target_parameters=[]")),
], ids=["dense", "moe-replay"])
def test_mlx_samplers_train_an_async_swarm_every_group_proved(tmp_path, model, overrides):
    """`echo-rl up` with sampler.engine = "mlx": both samplers draw with MLX, the trainer proves
    every group (the default verify_fraction 1) and trains on them; on the mixture of experts
    every group carries the routing the trainer replays. On the dense model a third sampler joins
    meanwhile and forges: it draws a granted slot's group with MLX, as the honest ones do, swaps
    one token and sends that token's true log-probs under the version it ran; the trainer strikes
    it for a token forgery and trains nothing of it."""
    struck: list[Strikes | BaseException] = []

    def forge(up_pid: int) -> None:
        try:
            struck.append(asyncio.run(_forge(tmp_path / "mlx", psutil.Process(up_pid))))
        except BaseException as e:  # said by the assertion below, not lost in this thread
            struck.append(e)

    meanwhile = None if model == "tiny-moe" else forge
    # the trainer grants work once one sampler asks (up's default: both), here the forger alone at first
    joined = ("trainer.min_samplers=1",) if meanwhile else ()
    metrics, stream, _ = run_swarm(tmp_path, "mlx", 4, 'sampler.engine="mlx"', "trainer.max_staleness=1", *overrides,
                                   *joined, model=model, meanwhile=meanwhile)
    assert stream and {r["group"]["engine"] for r in stream} == {"mlx"}
    assert all((r["group"]["routing"] is not None) == (model == "tiny-moe") for r in stream)
    if meanwhile is None:
        assert_every_group_proved(metrics)
        return
    assert struck and struck[0].counts == {"s3": 1} and struck[0].suspects == ["s3"], struck
    rejected = [reason for m in metrics for reason, n in m["rejected"].items() for _ in range(n)]
    assert rejected.count("token_forgery") == 1 and set(rejected) <= {"token_forgery", "stale"}, rejected
    proof = metrics[-1]["proof_of_sampling"]
    assert proof.get("passed", 0) >= sum(m["used"] for m in metrics) and proof.get("forged") == 1, proof
    assert {r["group"]["sampler_id"] for r in stream} == {"s1", "s2", "s3"}


async def _forge(run_dir, up: psutil.Process) -> Strikes:
    """A sampler s3 of `up`'s run in `run_dir`, with an MLX engine: it sends one granted slot's
    group with one token forged (true log-probs under the version it runs), and returns the run's
    strikes once the trainer has struck it. The honest samplers are held (SIGSTOP) from their
    start until that group is sent: the trainer, short of groups, cannot end the run before it
    has judged it."""
    def forked() -> list[psutil.Process] | None:  # by up: the trainer, then the samplers
        workers = sorted((p for p in up.children() if "nats" not in p.name()), key=lambda p: (p.create_time(), p.pid))
        return workers if len(workers) >= 3 else None

    _, *samplers = await eventually_async(forked, 120, every=0.02)
    for sampler in samplers:
        sampler.suspend()
    try:
        cfg = load_config(run_dir / "config.toml")
        run = await open_run(cfg.nats.url, cfg.run.id, "s3", create=False)
        follower = await WeightsFollower(run, base_model_digest(cfg.model.name)).start()
        engine, policy = MLXEngine(cfg.model, cfg.lora, cfg.sampling), HFEngine("tiny", cfg.lora, cfg.sampling, "cpu")
        announcement, shards = await follower.wait_for(0)
        engine.load_weights(shards)
        policy.load_weights(shards)
        grant = None
        while not (grant and grant.slots):
            grant = await request_grant(run, "s3", GrantRequest(want=1, term=announcement.term,
                                                                version=announcement.version, process="f0"))
        slot, noise = grant.slots[0], grant.keyed_slots()[0]
        [group] = keyed_groups(engine, grant.prompts, cfg.run.seed, announcement.term, cfg.sampling.group_size,
                               first_slot=noise)
        first = group.completions[0]
        swapped = first.token_ids.tolist()
        swapped[0] = (swapped[0] + 1) % len(engine.tokenizer)
        with torch.no_grad():
            logprobs = group_logprobs(policy.model, group.prompt_token_ids, [swapped], cfg.sampling.temperature,
                                      engine.tokenizer.pad_token_id)[0][0, : len(swapped)].tolist()
        forged = group.replaced(slot=slot, noise_slot=None if noise == slot else noise, sampler_id="s3",
                                version=announcement.version, engine="mlx", group_id=uuid.uuid4().hex, completions=[
            first.replaced(token_ids=swapped, logprobs=logprobs), *group.completions[1:]])
        await publish_rollout(run, forged)
    finally:
        for sampler in samplers:
            sampler.resume()
    try:
        async def struck():
            strikes = await read_strikes(run)
            return strikes if strikes.counts else None

        return await eventually_async(struck, 240, every=0.1)
    finally:
        await follower.stop()
        await run.close()


def test_one_model_over_two_ranks_draws_what_it_draws_whole_and_a_hung_or_lost_rank_is_noticed(tmp_path):
    """sampler.ranks = 2 on this box: rank 1 started here (workers/sampler/ranks.py), mlx-lm's
    pipeline giving each rank half the layers. Versions and calls go from rank 0 to rank 1; the
    split model's keyed draws and log-probs are the whole model's, a version swapped in between
    chunks included. Rank 1 stopped (SIGSTOP: hung, not gone) during a call: noticed once rank 0
    has waited sampler.rank_timeout_s, not before; then killed: the watch names the exit. The
    blocked call itself fails ("connection to a peer was lost") or stays blocked: mlx's ring
    promises neither (CI, 2026-12-06: still blocked 60 s after the ring said "Failing pending
    tasks"), and the sampler waits for neither: its watch starts it again as a new process
    (RankWatch.start_again)."""
    timeout_s = 3.0
    cfg = tiny_config(tmp_path, lora={"r": LORA.r, "alpha": LORA.alpha},
                      sampling={**SAMPLING.model_dump(), "chunk_tokens": 8},
                      sampler={"engine": "mlx", "ranks": 2, "rank_timeout_s": timeout_s})
    _, versions = _versions("tiny", LORA, 2)
    lost = []
    group, watch = start_ranks(cfg, on_lost=lambda why: lost.append((why, time.monotonic())))
    split = MLXEngine(_model("tiny"), LORA, cfg.sampling, group=group)
    watch.engine = split
    whole = MLXEngine(_model("tiny"), LORA, cfg.sampling)
    assert split.layers == (1, 2)  # its half of the tiny model's 2 layers: rank 0 the last
    # each rank holds the embeddings, head and its layer: less than the whole, together more
    assert len(split.rank_mb) == 2 and max(split.rank_mb) < whole.rank_mb[0] < sum(split.rank_mb)

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
    assert watch.trouble(time.monotonic()) is None and not lost  # a whole call's waits, none too long

    rank1 = watch.processes[0]
    rank1.send_signal(signal.SIGSTOP)
    failed = []

    def call():
        try:
            split.generate(ids, 8, draws=draws)
        except RuntimeError as e:  # the ring's "connection to a peer was lost", once rank 1 is killed
            failed.append(str(e))

    started = time.monotonic()
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    (why, at), = eventually(lambda: lost, 60, every=0.05)
    assert "no answer from the other ranks" in why and at - started >= timeout_s
    rank1.kill()
    rank1.wait(timeout=60)
    assert watch.trouble(time.monotonic()) == "rank 1 exited with code -9"
    caller.join(timeout=10)
    assert not failed or "peer" in failed[0]  # if it failed, for the lost peer


def test_the_layers_are_split_in_proportion_to_each_ranks_memory():
    """mlx-lm's pipeline takes a count a rank; each gets its share by memory, at least one layer."""
    assert layer_split(30, [16.0, 16.0]) == [15, 15]
    assert layer_split(30, [8.0, 16.0, 8.0]) == [8, 14, 8]  # 27 spread: 6.75, 13.5, 6.75, then the remainders
    assert layer_split(31, [1.0, 1.0]) == [16, 15]  # a tie: the lower rank, as mlx-lm's even split
    assert layer_split(4, [1.0, 1000.0]) == [1, 3]  # the smallest still holds a layer
    assert sum(layer_split(61, [24.0, 36.0, 128.0, 8.0])) == 61
    with pytest.raises(ConfigError, match="sampler.ranks = 3: the model has 2 decoder layers"):
        layer_split(2, [1.0, 1.0, 1.0])


def test_a_split_mlx_sampler_trains_a_swarm_every_group_proved_through_a_hung_and_a_killed_rank(tmp_path):
    """`echo-rl up` with sampler.ranks = 2: each sampler starts its second rank itself, and the
    trainer proves every group. Once the run is under way, s1's rank 1 hangs (SIGSTOP) and s2's
    is killed, with the trainer held still (SIGSTOP: no grant, so no call, and the run cannot end
    meanwhile): each sampler notices (the hung rank by rank 0's ping between calls) and starts
    again with a new rank, whose heartbeat says the group was lost once, and why. Then the run
    goes on, and trains nothing but proven groups."""
    run_dir = tmp_path / "mlx-split"

    def ranks_of(up: psutil.Process) -> dict[int, int]:
        """The sampler ranks running under `up`: pid -> its sampler's pid."""
        ranks = {}
        for p in up.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # a zombie or gone: not running
                if "workers.sampler.ranks" in " ".join(p.cmdline()):
                    ranks[p.pid] = p.ppid()
        return ranks

    def heartbeats() -> dict[str, SamplerStatus]:
        """Each sampler's heartbeat (a new process: it started again)."""
        async def read():
            run = await open_run(load_config(run_dir / "config.toml").nats.url, "mlx-split", "check", create=False)
            try:
                return {s.sampler_id: s for s in await read_statuses(run)}
            finally:
                await run.close()
        return asyncio.run(read())

    failed = []

    def disturb(up_pid: int) -> None:
        up = psutil.Process(up_pid)
        # A step trained: both samplers' ranks are up.
        eventually(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_bytes(), 280)
        ranks, before = ranks_of(up), heartbeats()
        (hung, _), (killed, _) = ranks.items()
        trainer, = [p for p in up.children() if p.pid not in ranks.values() and "nats" not in p.name()]
        trainer.suspend()
        try:
            psutil.Process(hung).suspend()
            psutil.Process(killed).kill()
            def restarted():
                now = heartbeats()
                return now if now.keys() == before.keys() and all(now[s].process != before[s].process
                                                                   for s in before) else None

            # A guard: each sampler is back in seconds.
            now = eventually(restarted, 300, every=0.2, why=lambda _: f"not every sampler started again: {before}")
            assert {(s.ranks, s.ranks_restarted, s.rank_lost) for s in before.values()} == {(2, 0, "")}
            assert {(s.ranks, s.ranks_restarted) for s in now.values()} == {(2, 1)}
            said = sorted(s.rank_lost for s in now.values())
            assert "no answer from the other ranks" in " ".join(said), said
            assert "exited with code -9" in " ".join(said) or "a collective failed" in " ".join(said), said
        except BaseException as e:
            failed.append(e)
        finally:
            trainer.resume()

    metrics, stream, stderr = run_swarm(tmp_path, "mlx-split", 4, 'sampler.engine="mlx"', "sampler.ranks=2",
                                        "sampler.rank_timeout_s=3", meanwhile=disturb)
    assert not failed, failed
    proof = metrics[-1]["proof_of_sampling"]
    assert proof.get("passed", 0) >= sum(m["used"] for m in metrics) and set(proof) == {"passed"}, proof
    # Refused, with no strike, at most: a group its sampler's predecessor published before it went,
    # read once the trainer had handed that slot out again (echo/fleet/grants.py: a restart's slots go).
    assert {reason for m in metrics for reason in m["rejected"]} <= {"slot_not_held"}, [m["rejected"] for m in metrics]
    assert stream and {r["group"]["engine"] for r in stream} == {"mlx"}
    lost = [line for line in stderr.splitlines() if "sampler.rank_lost" in line]
    assert len(lost) == 2, stderr[-3000:]
    assert any("no answer from the other ranks" in line for line in lost), lost
    assert any("exited with code -9" in line or "a collective failed" in line for line in lost), lost
    assert stderr.count("sampler.split") == 4  # each sampler's ranks, and each again


RANK0 = """
import json, os, sys
from pathlib import Path
from echo.config import load_config
from echo.engines.mlx import MLXEngine
from workers.sampler.ranks import start_ranks
cfg = load_config(Path(sys.argv[1]))
group, watch = start_ranks(cfg, on_lost=lambda why: None)
engine = MLXEngine(cfg.model, cfg.lora, cfg.sampling, group=group)
engine.load_weights([bytearray(Path(sys.argv[2]).read_bytes())])
out = engine.generate(json.loads(sys.argv[3]), 4, greedy=True)
print(json.dumps([[g.token_ids for g in gens] for gens in out]), flush=True)
if sys.argv[4] == "vanish":
    os._exit(0)  # as a machine that drops off: no word to rank 1
engine.stop_followers()
"""


def test_ranks_on_other_machines_follow_a_hostfile_and_outlive_rank_0(tmp_path):
    """sampler.hostfile: rank 1 started by its own command (`echo-rl rank`, as on another box),
    rank 0 (the sampler) starting none. The split model generates the whole model's tokens. Rank 0
    gone without a word: rank 1 starts again by itself (the same port) and serves the next rank 0;
    told to stop, it exits."""
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    cfg = tiny_config(tmp_path, sampler={"engine": "mlx", "ranks": 2, "hostfile": str(hostfile)})
    config = tmp_path / "sampler.toml"
    config.write_text(cfg.to_toml())
    _, versions = _versions("tiny", cfg.lora, 1)
    (weights := tmp_path / "v0.safetensors").write_bytes(bytes(versions[0][0]))
    whole = MLXEngine(_model("tiny"), cfg.lora, cfg.sampling)
    whole.load_weights(versions[0])
    ids = [whole.encode_chat(TASK.prompt(i).messages) for i in (1, 2)]
    expected = [[g.token_ids for g in gens] for gens in whole.generate(ids, 4, greedy=True)]

    rank1 = subprocess.Popen([sys.executable, "-m", "workers.cli", "rank", "--config", str(config), "--rank", "1"],
                             stderr=subprocess.PIPE, text=True)
    try:
        for end in ("vanish", "stop"):
            rank0 = subprocess.run([sys.executable, "-c", RANK0, str(config), str(weights), json.dumps(ids), end],
                                   capture_output=True, text=True, timeout=300)
            assert rank0.returncode == 0, rank0.stderr[-3000:]
            assert json.loads(rank0.stdout.splitlines()[-1]) == expected
        assert rank1.wait(timeout=120) == 0
        said = rank1.stderr.read()
        assert said.count("rank.ready") == 2 and "rank.no_group" in said, said[-3000:]
    finally:
        stopped(rank1)
