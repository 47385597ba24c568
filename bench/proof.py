"""Benchmark: the proof of sampling, honest and forged, at fp32 and bf16.

An honest sampler (the transformers engine, keyed noise: echo/trust/noise.py) generates groups with a
LoRA adapter at version 0; the trainer's SamplingProof checks them, once as its newest version
and once after it moved on to version 1 (version 0 swapped in). Recorded per configuration
(model, the sampler's precision):

- honest: the largest log-prob gap and token margin of each group, and the false positives
  (groups the check would reject: there must be none);
- forged tokens: a share of each group's tokens (1 in 64, 5%, 20%) replaced, the log-probs then
  recomputed under the policy (a forger who runs the model forward reports true ones), and the
  share of such groups caught;
- forged log-probs: every claimed log-prob shifted by a little (what log-probs alone catch);
- cost: the check's seconds per group against a trainer step's seconds per group on the same
  groups (train_step), and generation's.

    .venv/bin/python -m bench.proof [--models tiny smollm2] [--dtypes float32 bfloat16] [--groups 64]
        [--engine hf | hf-paged | vllm | mlx] [--compute-dtype float32 | bfloat16]  (vllm: in .venv-vllm)

Writes bench/results/proof-<models>.json (with the machine's load). With --every, what proving
every group costs an honest async run at staleness bounds 1 and 2 (the groups of older versions
checked one at a time, as the intake does, and together: check_many), into proof-every-<models>.json. With --in-step, only what
proving the held version's groups inside the step costs (train_step with and without HeldProof,
alternated on the same groups, the least of `--repeats` each), into proof-in-step-<models>.json;
on a CPU also the seconds spent in the check's own code as a share of the step (the difference
of the least seconds moves by more than that on a busy 2-core box).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch

from bench.common import write_results
from echo.config import LoraConfig, ModelConfig, SamplingConfig, TaskConfig, TrainerConfig, validate_config
from echo.engines.hf import HFEngine, PagedEngine
from echo.model.devices import DTYPES, dtype_name, model_device
from echo.model.policy import group_logprobs
from echo.tasks import load_task
from echo.train import learner
from echo.train.learner import Batch, Forward, HeldProof, Rewarded, make_optimizer, train_step
from echo.trust.noise import Draw, TokenMargins, group_key, gumbel
from echo.trust.proof import ProofSettings, SamplingProof
from echo.weights.shards import load_weights, weights_shards
from echo.wire.messages import Completion, RolloutGroup

SEED = 0
TOKEN_SHARES = [1 / 64, 0.05, 0.20]  # of a group's tokens replaced
LOGPROB_SHIFTS = [0.5, 0.1, 0.02]  # nats subtracted from every claimed log-prob
NEAR_TIE_GROUPS = 256  # groups whose every position's noisy scores are ranked (a forward each completion)


def perturb_adapter(model, seed: int, scale: float) -> None:
    """A trained-looking adapter: lora_B is zero at init, which would make every version the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def honest_groups(engine: HFEngine, task, count: int, group_size: int, prompts_per_call: int) -> list[RolloutGroup]:
    """`count` groups on slots 1..count, drawn with their slots' keyed noise."""
    groups = []
    for start in range(0, count, prompts_per_call):
        prompts = [task.prompt(i) for i in range(start, min(count, start + prompts_per_call))]
        ids = [engine.encode_chat(p.messages) for p in prompts]
        keys = [group_key(SEED, 0, p.index + 1) for p in prompts]
        draws = [Draw(key) for key in keys]
        for prompt, prompt_ids, gens in zip(prompts, ids, engine.generate(ids, group_size, draws=draws)):
            completions = [Completion(token_ids=g.token_ids, logprobs=g.logprobs, text=g.text, claimed_reward=0.0,
                                      finish_reason=g.finish_reason) for g in gens]
            groups.append(RolloutGroup(group_id=f"g{prompt.index}", sampler_id="honest", version=0, task=task.name,
                                       prompt_index=prompt.index, slot=prompt.index + 1, term=0,
                                       prompt_token_ids=prompt_ids, completions=completions,
                                       temperature=engine.temperature, engine=engine.name, dtype=dtype_name(engine.dtype),
                                       gen_seconds=0.0, created_at=0.0))
    return groups


def with_true_logprobs(proof: SamplingProof, group: RolloutGroup, token_ids: list[list[int]]) -> RolloutGroup:
    """The group with these tokens and the policy's own log-probs of them (version 0 in place)."""
    with torch.no_grad():
        logprobs, _, _ = group_logprobs(proof.model, group.prompt_token_ids, token_ids, proof.temperature, proof.pad_id)
    return group.replaced(sampler_id="forger", completions=[
        c.replaced(token_ids=ids, logprobs=logprobs[i, : len(ids)].tolist()) for i, (c, ids) in
        enumerate(zip(group.completions, token_ids))])


def tokens_replaced(group: RolloutGroup, share: float, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """A `share` of the group's tokens (at least one) replaced by other ids, at random."""
    ids = [c.token_ids.tolist() for c in group.completions]
    where = [(row, k) for row, row_ids in enumerate(ids) for k in range(len(row_ids))]
    for index in rng.choice(len(where), size=max(1, round(share * len(where))), replace=False):
        row, k = where[index]
        ids[row][k] = int((ids[row][k] + rng.integers(1, vocab)) % vocab)
    return ids


def sampler_engine(name: str, model_name: str, lora: LoraConfig, sampling: SamplingConfig, device: str, dtype: str):
    """The sampler's engine, as `sampler.engine = name` builds it."""
    if name == "vllm":
        from echo.engines.vllm import VLLMEngine

        return VLLMEngine(ModelConfig(name=model_name, device=device, dtype=dtype), lora, sampling)
    if name == "mlx":
        from echo.engines.mlx import MLXEngine

        return MLXEngine(ModelConfig(name=model_name, device=device, dtype=dtype), lora, sampling)
    return (PagedEngine if name == "hf-paged" else HFEngine)(model_name, lora, sampling, device, dtype)


@torch.no_grad()
def near_ties(model, groups: list[RolloutGroup], temperature: float, margins: list[float]) -> dict[str, float]:
    """What can still slip past the token check: the share of honest tokens where another token's
    noisy score is within a margin of the drawn one's (the runner-up a forger could send instead),
    from the trainer's own logits (fp32), for each margin."""
    gaps = []
    for group in groups:
        key, prompt = group_key(SEED, group.term, group.slot), group.prompt_token_ids.tolist()
        for j, completion in enumerate(group.completions):
            ids = torch.tensor([prompt + completion.token_ids.tolist()], device=model_device(model))
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            noisy = logits + gumbel(key, j, torch.arange(len(completion.token_ids), device=logits.device),
                                    logits.shape[-1])
            top = noisy.topk(2, dim=-1).values
            gaps.append((top[:, 0] - top[:, 1]).cpu())
    gaps = torch.cat(gaps)
    return {str(margin): float((gaps < margin).float().mean()) for margin in margins}


def measure(model_name: str, dtype: str, count: int, device: str, engine_name: str = "hf",
            compute: str = "float32") -> dict:
    """`count` honest groups from an `engine_name` sampler in `dtype`, checked by a trainer whose
    forward runs in `compute`; then forged ones."""
    sampling = SamplingConfig(group_size=8, max_new_tokens=32, temperature=0.7, prompts_per_call=4,
                              dtypes=["float32", "bfloat16"])
    # mlx-lm's stacked experts take no LoRA of the trainer's: a mixture of experts adapts its attention
    lora = LoraConfig(r=16, alpha=32.0, **({"target_parameters": []} if engine_name == "mlx" else {}))
    trainer = HFEngine(model_name, lora, sampling, device, "float32").model
    perturb_adapter(trainer, seed=0, scale=0.02)
    engine = sampler_engine(engine_name, model_name, lora, sampling, device, dtype)
    engine.load_weights([bytearray(s) for s in weights_shards(trainer, 2**30)])  # version 0, as published
    task = load_task(TaskConfig())
    started = time.perf_counter()
    groups = honest_groups(engine, task, count, sampling.group_size, sampling.prompts_per_call)
    generate_seconds = time.perf_counter() - started
    tcfg = TrainerConfig()
    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id, ProofSettings(
        sampling.temperature, 1.0, tcfg.verify_tolerance, keep=2, tolerance_16bit=tcfg.verify_tolerance_16bit,
        compute_dtype=DTYPES[compute], noise_seed=SEED, margin=tcfg.verify_margin,
        margin_16bit=tcfg.verify_margin_16bit))
    proof.remember(0)
    started = time.perf_counter()
    current = [proof.check(g) for g in groups]
    check_seconds = time.perf_counter() - started
    rng = np.random.default_rng(0)
    vocab = trainer.get_output_embeddings().weight.shape[0]
    token_forgeries = {f"{share:.4f}": [with_true_logprobs(proof, g, tokens_replaced(g, share, vocab, rng))
                                        for g in groups] for share in TOKEN_SHARES}
    logprob_forgeries = {str(shift): [g.replaced(sampler_id="forger", completions=[
        c.replaced(logprobs=np.minimum(c.logprobs - shift, 0.0)) for c in g.completions]) for g in groups]
        for shift in LOGPROB_SHIFTS}

    def caught(fakes: list[RolloutGroup]) -> float:
        return sum(proof.forged(f, proof.check(f)) is not None for f in fakes) / len(fakes)

    tokens_caught = {share: caught(fakes) for share, fakes in token_forgeries.items()}
    ties = near_ties(trainer, groups[:NEAR_TIE_GROUPS], sampling.temperature, [tcfg.verify_margin, tcfg.verify_margin_16bit])
    logprobs_caught = {shift: caught(fakes) for shift, fakes in logprob_forgeries.items()}
    train_seconds = train_seconds_per_group(trainer, groups[:4], model_name, proof.pad_id)
    perturb_adapter(trainer, seed=1, scale=0.02)  # the trainer takes a step: version 1
    proof.remember(1)
    stale = [proof.check(g) for g in groups]  # version 0 swapped in for each, then 1 back
    honest = current + stale
    margins = [c.margin for c in honest]
    return {
        "model": model_name,
        "engine": engine_name,
        "sampler_dtype": dtype,
        "trainer_compute_dtype": compute,
        "groups": len(groups),
        "completions": sum(len(g.completions) for g in groups),
        "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
        "honest_gap_max": max(c.gap for c in honest),
        "honest_gap_median": statistics.median(c.gap for c in honest),
        "honest_margin_max": max(margins),
        "honest_margin_p99": sorted(margins)[int(0.99 * (len(margins) - 1))],
        "false_positives": sum(proof.forged(g, c) is not None for g, c in zip(groups + groups, honest)),
        "token_forgeries_caught": tokens_caught,
        "near_tie_share": ties,  # of honest tokens, by margin: where a runner-up would pass (first NEAR_TIE_GROUPS)  # by share of tokens replaced, true log-probs
        "logprob_forgeries_caught": logprobs_caught,  # by shift in nats
        "check_seconds_per_group": check_seconds / len(groups),
        "train_seconds_per_group": train_seconds,
        "check_share_of_step": round(check_seconds / len(groups) / train_seconds, 3),
        "generate_seconds_per_group": generate_seconds / len(groups),
    }


def in_step_cost(model_name: str, count: int, repeats: int, device: str, compute: str) -> dict:
    """A step on `count` honest fp32 groups of version 0, with and without proving them from its
    own forward (HeldProof), alternated; the least seconds of each. The step's forward runs in
    `compute` (a GPU trainer's is bfloat16: the proof's 16-bit bands then apply)."""
    sampling = SamplingConfig(group_size=8, max_new_tokens=32, temperature=0.7, prompts_per_call=4)
    lora = LoraConfig(r=16, alpha=32.0)
    engine = HFEngine(model_name, lora, sampling, device, "float32")
    trainer = HFEngine(model_name, lora, sampling, device, "float32").model
    perturb_adapter(engine.model, seed=0, scale=0.02)
    load_weights(trainer, [bytearray(s) for s in weights_shards(engine.model, 2**30)])
    groups = honest_groups(engine, load_task(TaskConfig()), count, sampling.group_size, sampling.prompts_per_call)
    tcfg, compute_dtype = TrainerConfig(), DTYPES[compute]
    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id, ProofSettings(
        sampling.temperature, 1.0, tcfg.verify_tolerance, keep=2, tolerance_16bit=tcfg.verify_tolerance_16bit,
        compute_dtype=compute_dtype, noise_seed=SEED, margin=tcfg.verify_margin, margin_16bit=tcfg.verify_margin_16bit))
    by_id = {g.group_id: g for g in groups}
    spent = [0.0]  # seconds inside the check's own code, every in-step step together
    held = HeldProof(0, proof.noise_key, timed(lambda checked: proof.judged_in_step(by_id, checked), spent))
    seconds: dict[str, list[float]] = {"plain": [], "in_step": []}
    with checks_timed(spent):
        for _ in range(repeats):
            seconds["plain"].append(train_seconds_per_group(trainer, groups, model_name, proof.pad_id,
                                                            compute_dtype=compute_dtype))
            seconds["in_step"].append(train_seconds_per_group(trainer, groups, model_name, proof.pad_id, held,
                                                              compute_dtype))
    plain, in_step = min(seconds["plain"]), min(seconds["in_step"])
    result = {"model": model_name, "compute_dtype": compute, "groups": count,
              "completions": count * sampling.group_size,
              "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
              "step_seconds_per_group": plain, "proved_step_seconds_per_group": in_step,
              "in_step_share_of_step": round(in_step / plain - 1, 4), "seconds": seconds,
              "passed": proof.counts["passed"], "forged": proof.counts["forged"]}
    if device == "cpu":  # each op done when it returns: the check's own seconds are its cost
        check = spent[0] / repeats / count
        result |= {"check_seconds_per_group": check,
                   "check_share_of_step": round(check / statistics.median(seconds["plain"]), 4)}
    return result


def every_group_cost(model_name: str, count: int, staleness: int, repeats: int, device: str, compute: str) -> dict:
    """What proving every group costs an honest async run (trainer.verify_fraction 1, the default):
    a step's `count` groups, a third of the trainer's version S and the rest spread over the S
    versions before it (the issue's swarm trained {"0": 173, "1": 347} at S = 1), each honest and
    drawn by its version. The step proves its own version's groups from its forward (HeldProof);
    the others are proven under their versions, one group at a time (SamplingProof.check, as the
    intake judges them) or together (check_many: a version swapped in once, forwards of several
    groups). The least seconds of `repeats`, alternated, each against the step's."""
    sampling = SamplingConfig(group_size=8, max_new_tokens=32, temperature=0.7, prompts_per_call=4)
    lora = LoraConfig(r=16, alpha=32.0)
    engine = HFEngine(model_name, lora, sampling, device, "float32")
    trainer = HFEngine(model_name, lora, sampling, device, "float32").model
    tcfg, compute_dtype = TrainerConfig(), DTYPES[compute]
    proof = SamplingProof(trainer, engine.tokenizer.pad_token_id, ProofSettings(
        sampling.temperature, 1.0, tcfg.verify_tolerance, keep=staleness + 1,
        tolerance_16bit=tcfg.verify_tolerance_16bit, compute_dtype=compute_dtype, noise_seed=SEED,
        margin=tcfg.verify_margin, margin_16bit=tcfg.verify_margin_16bit))
    task, held_count = load_task(TaskConfig()), count // 3
    versions = [staleness] * held_count + [staleness - 1 - i % staleness for i in range(count - held_count)]
    groups = []
    for version in range(staleness + 1):  # as the trainer publishes them; each version draws its groups
        perturb_adapter(trainer, seed=version, scale=0.02)
        proof.remember(version)
        load_weights(engine.model, [bytearray(s) for s in weights_shards(trainer, 2**30)])
        mine = [i for i, v in enumerate(versions) if v == version]
        drawn = honest_groups(engine, task, count, sampling.group_size, sampling.prompts_per_call)
        groups += [drawn[i].replaced(version=version) for i in mine]
    older = [g for g in groups if g.version != staleness]
    by_id = {g.group_id: g for g in groups}
    held = HeldProof(staleness, proof.noise_key, lambda checked: proof.judged_in_step(by_id, checked))
    seconds: dict[str, list[float]] = {"step": [], "one_at_a_time": [], "together": []}
    for _ in range(repeats):
        seconds["step"].append(train_seconds_per_group(trainer, groups, model_name, proof.pad_id, held,
                                                       compute_dtype) * len(groups))
        started = time.perf_counter()
        one = [proof.check(g) for g in older]
        seconds["one_at_a_time"].append(time.perf_counter() - started)
        started = time.perf_counter()
        together = proof.check_many(older)
        seconds["together"].append(time.perf_counter() - started)
        assert all(c is not None and not proof.forged(g, c) for g, c in zip(older, one)), "an honest group failed"
        assert all(not proof.forged(g, together[g.group_id]) for g in older), "an honest group failed"
    step, one_at_a_time, together = (min(seconds[k]) for k in ("step", "one_at_a_time", "together"))
    return {"model": model_name, "staleness": staleness, "compute_dtype": compute, "groups": count,
            "groups_of_older_versions": len(older),
            "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
            "step_seconds": step, "one_at_a_time_seconds": one_at_a_time, "together_seconds": together,
            "one_at_a_time_share_of_step": round(one_at_a_time / step, 4),
            "together_share_of_step": round(together / step, 4), "seconds": seconds,
            "passed": proof.counts["passed"], "forged": proof.counts["forged"]}


def timed(function, spent: list[float]):
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started
    return run


@contextlib.contextmanager
def checks_timed(spent: list[float]):
    """Adds to spent[0] the seconds the step spends in the in-step check's code: the token
    margins read from each chunk's logits, the held groups' noise and checks (the judge is
    timed where it is made). The difference of two steps' least seconds is the measure a GPU
    allows; on a busy CPU it moves by more than the check costs."""
    saved = TokenMargins.__call__, learner.held_noise, learner.held_checks
    TokenMargins.__call__ = timed(TokenMargins.__call__, spent)
    learner.held_noise, learner.held_checks = timed(learner.held_noise, spent), timed(learner.held_checks, spent)
    try:
        yield
    finally:
        TokenMargins.__call__, learner.held_noise, learner.held_checks = saved


def train_seconds_per_group(model, groups: list[RolloutGroup], model_name: str, pad_id: int,
                            held: HeldProof | None = None, compute_dtype: torch.dtype = torch.float32) -> float:
    """One optimizer step on these groups, per group (the adapter moves, then is put back)."""
    cfg = validate_config({"model": {"name": model_name}, "lora": {"r": 16, "alpha": 32.0},
                           "sampling": {"temperature": 0.7}})
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    batch = Batch([Rewarded(g, [float(i % 2) for i in range(len(g.completions))]) for g in groups])
    started = time.perf_counter()
    train_step(Forward.of(model, cfg, pad_id, compute_dtype), make_optimizer(model, cfg), batch, held=held)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    with torch.no_grad():
        for k, v in model.named_parameters():
            if v.requires_grad:
                v.copy_(before[k])
    model.eval()
    return seconds / len(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the sampler's precision")
    parser.add_argument("--groups", type=int, default=64, help="honest groups per configuration, each checked twice")
    parser.add_argument("--in-step", action="store_true", help="only the cost of proving inside the step")
    parser.add_argument("--repeats", type=int, default=3, help="--in-step, --every: steps of each kind")
    parser.add_argument("--every", action="store_true",
                        help="only what proving every group costs an honest async run (S = 1 and 2)")
    parser.add_argument("--device", default="cpu", help="where both the sampler and the trainer run")
    parser.add_argument("--compute-dtype", default="float32", help="the trainer's forward")
    parser.add_argument("--engine", default="hf", choices=["hf", "hf-paged", "vllm", "mlx"], help="the sampler's")
    args = parser.parse_args()
    torch.manual_seed(0)
    suffix = "" if args.device == "cpu" else "-gpu"  # a GPU's figures beside the CPU's, not over them
    if args.every:
        results = {"torch_threads": torch.get_num_threads(), "device": args.device,
                   "results": [every_group_cost(m, args.groups, staleness, args.repeats, args.device,
                                                args.compute_dtype)
                               for m in args.models for staleness in (1, 2)]}
        suffix += "" if args.compute_dtype == "float32" else f"-{args.compute_dtype}"
        print(write_results(f"proof-every-{'-'.join(args.models)}{suffix}.json", results).read_text())
        return
    if args.in_step:
        results = {"torch_threads": torch.get_num_threads(), "device": args.device,
                   "results": [in_step_cost(m, args.groups, args.repeats, args.device, args.compute_dtype)
                               for m in args.models]}
        if args.compute_dtype != "float32":
            suffix += f"-{args.compute_dtype}"
        print(write_results(f"proof-in-step-{'-'.join(args.models)}{suffix}.json", results).read_text())
        return
    tcfg = TrainerConfig()
    results = {
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "tolerance": [tcfg.verify_tolerance, tcfg.verify_tolerance_16bit],
        "margin": [tcfg.verify_margin, tcfg.verify_margin_16bit],
        "results": [measure(m, d, args.groups, args.device, args.engine, args.compute_dtype)
                    for m in args.models for d in args.dtypes],
    }
    suffix = ("" if args.engine == "hf" else f"-{args.engine}") + suffix
    suffix += "" if args.compute_dtype == "float32" else f"-trainer-{args.compute_dtype}"
    out = write_results(f"proof-{'-'.join(args.models)}{suffix}.json", results)
    print(out.read_text())


if __name__ == "__main__":
    main()
