"""One typed config for a run: a TOML file plus `--set section.key=value` overrides.

Validated at start: an unknown key or a bad value fails with a ConfigError naming the field.
Beside it: reference.py (docs/config.md, written from these fields) and edge.py (what an edge
sampler accepts from the run's config on the broker).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.wire.names import HUB_DOMAIN, ID_PATTERN, MAX_CHAIN, Storage


class ConfigError(ValueError):
    pass


def cache_dir() -> Path:
    """What echo-rl builds once and keeps: converted models, weight digests, dataset shards."""
    return Path(os.environ.get("ECHO_CACHE", Path.home() / ".cache" / "echo-rl"))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    # Names the run's streams, buckets and directory; a trainer started again with it resumes.
    id: str = Field(default_factory=lambda: time.strftime("run-%Y%m%d-%H%M%S"), pattern=ID_PATTERN)
    dir: str = "runs"  # the run directory is `<dir>/<id>`
    mode: Literal["async", "sequential"] = "async"  # sequential: the trainer asks, samplers refresh, then generate
    steps: int = Field(20, ge=1)  # training steps (policy versions published) in the run
    seed: int = 0  # the adapter's initialisation and the trainer's randomness: `replay --retrain` relies on it
    eval_prompts: int = Field(50, ge=0)  # `echo-rl up` scores base vs trained on this many held-out prompts
    # Evaluate the version just published every this many steps, on eval_prompts held-out prompts,
    # greedy, on the trainer's machine between steps (workers/trainer/evaluation.py); 0: never.
    eval_every: int = Field(0, ge=0)
    # With eval_every: the base model (version 0) scored the same way before step 1, the curve's
    # first point (verl's trainer.val_before_train).
    eval_before: bool = True
    # Experiment trackers the trainer writes each step to (workers/trainer/trackers.py), each an
    # extra (`pip install 'echo-rl[trackers]'`): TensorBoard event files in <run dir>/tensorboard,
    # W&B (offline unless WANDB_MODE or WANDB_API_KEY is set; the tracker run's id is this run's),
    # MLflow (a SQLite store, <run dir>/mlflow.db, unless MLFLOW_TRACKING_URI is set).
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    project: str = "echo-rl"  # the W&B project and the MLflow experiment
    # Completions shown each step, to read why a run learns or not: the best of one group, the
    # worst of the next (echo/train/diagnosis.py), in <run dir>/samples.jsonl, the trackers and the page.
    samples_per_step: int = Field(2, ge=0, le=64)
    log_completions: bool = False  # those completions on the console too, each step (TRL's log_completions)


class ModelConfig(_Section):
    # "tiny", "smollm2", a local Hugging Face model folder, or a hub id "owner/name[@revision]"
    # (the trainer pins the revision to its commit: echo/model/hf_hub.py).
    name: str = "tiny"
    # This process's hardware (echo/model/devices.py): each process resolves "auto" on its own machine,
    # and an edge sampler ignores the trainer's choice (its command line's --set wins).
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    # auto: bf16 on a CUDA GPU that has it, fp16 on an older one and on MPS, fp32 on a CPU (echo/model/devices.py).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class LoraConfig(_Section):
    enabled: bool = True  # false: train and publish every parameter (full-weight mode)
    r: int = Field(16, ge=1)  # the adapter's rank
    alpha: float = Field(32.0, gt=0)  # its scale is alpha / r
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, while training
    # The layers the adapter wraps (Llama/Qwen2 names: attention and MLP projections).
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # And the weights it wraps that are not a layer's: a mixture of experts' experts, stacked in one
    # tensor a layer (transformers' Qwen3-MoE, Mixtral; peft's target_parameters). Names matching
    # no parameter of the model are left out, so a dense model takes none.
    target_parameters: list[str] = ["experts.gate_up_proj", "experts.down_proj"]


class TaskConfig(_Section):
    # math, dataset (a user's file: task.params.path), knights_knaves, sokoban, math_tools,
    # sokoban_game, reasoning_gym:<dataset>, or a module:Class / file.py:Class
    name: str = "math"
    params: dict[str, Any] = {}  # the task's own options, checked by the task (echo/tasks/)


class SamplingConfig(_Section):
    group_size: int = Field(8, ge=2)  # completions per prompt; GRPO needs at least two
    max_new_tokens: int = Field(24, ge=1)  # a completion's length limit
    temperature: float = Field(0.7, gt=0)  # of sampling (no top-p or top-k: the log-probs stay exact)
    # Partial rollouts (HF engine): generate this many tokens at a time and swap in newer weights
    # between chunks, so a long completion is not dropped whole as stale. 0: whole completions.
    chunk_tokens: int = Field(0, ge=0)
    prompts_per_call: int = Field(2, ge=1)  # groups generated in one engine call
    # The precisions a sampler may sample in. The proof of sampling allows a 16-bit sampler's
    # rounding (trainer.verify_tolerance_16bit, 50 times fp32's), so a sampler that may claim 16
    # bits may shade every log-prob by that much: the run, not the sampler, says whether it may.
    # A sampler whose model.dtype is auto samples in float32 where its machine's choice is not
    # here; add "bfloat16" for GPU samplers' speed.
    dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(["float32"], min_length=1)
    # Where a sampler's randomness comes from. keyed: Gumbel-max with noise keyed by the slot the
    # trainer granted (echo/trust/noise.py), so each token is a function of the policy's logits and the
    # trainer checks the tokens themselves, not only their log-probs; every engine here draws it
    # (hf, hf-paged on transformers 5.23+, vLLM). engine: the engine's own generator: the trainer
    # can then check log-probs only, so a sampler may send text it chose (docs/security.md).
    noise: Literal["keyed", "engine"] = "keyed"
    # Samplers whose text a keyed run trusts: they may run an engine that draws its own noise
    # (a user's own), and the trainer checks their groups' log-probs, not their tokens.
    trusted_samplers: list[str] = []


class TrainerConfig(_Section):
    groups_per_step: int = Field(4, ge=1)  # B: groups (prompts x group_size completions) trained per step
    # Forward and backpropagate a step's completions in passes of at most this many tokens (each
    # prompt in a pass once, plus each completion, all padded to the longest beside them): short
    # groups may share a pass (pack_groups), a long group is split; 0: a group a pass, however
    # long. The same step in fewer forwards or less memory: bench/micro_batches.py (a SmolLM2
    # group of 16 x 256 tokens peaks at 14.4 GB whole, 4.1 GB at 1024).
    micro_batch_tokens: int = Field(4096, ge=0)
    # Whether short groups share a pass: fewer forwards, each larger. auto: on a GPU (a small
    # model's forward there costs its kernel launches), not on a CPU (measured there: SmolLM2,
    # 8 groups of 8 x 32 tokens in one pass, 1.10x the time and 4.2x the memory of 8 passes).
    pack_groups: Literal["auto", "on", "off"] = "auto"
    lr: float = Field(1e-4, gt=0)  # AdamW's learning rate (the peak, under a schedule)
    # The learning rate over run.steps, as transformers' get_{constant,linear,cosine}_schedule_with_warmup:
    # from 0 up to lr over warmup_steps, then held, or down to 0 linearly or along a half cosine.
    # A function of the step alone: a resumed run goes on at the same rate (echo/train/learner.py).
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)  # steps of the linear warmup from 0 to lr
    # After this many steps in a row whose every group scored alike (no advantage: nothing
    # learned), one warning naming the likely cause (run.no_signal, echo/train/diagnosis.py); 0: never.
    no_signal_steps: int = Field(3, ge=0)
    weight_decay: float = Field(0.0, ge=0)  # AdamW's
    max_grad_norm: float = Field(1.0, gt=0)  # gradients clipped to this norm
    max_staleness: int = Field(1, ge=0)  # async: drop rollouts older than version - max_staleness; sequential uses 0
    # A sampler holding slots is dead when neither its heartbeat has changed nor it has asked
    # for work for sampler_dead_after_s, and stuck when it has delivered none of them for
    # reissue_after_s: its slots, and only those, are then handed out again.
    sampler_dead_after_s: float = Field(15.0, gt=0)
    # Stuck: slots held without a group accepted for 4 of the sampler's measured calls (the
    # fleet's median for one never measured), at least twice sampler_dead_after_s, at most this.
    reissue_after_s: float = Field(300.0, gt=0)
    # Grant no work until this many samplers have asked (0: start with the first). `up` sets it to
    # the samplers it starts, so that one ready first does not take a short run's every group.
    min_samplers: int = Field(0, ge=0)
    # Proof of sampling (echo/trust/proof.py): recompute the claimed log-probs (and, with keyed noise,
    # the tokens) of this share of groups under the versions that sampled them; a token off by
    # more than the tolerance (nats) is a forgery. 1: every group trained is proven, from a
    # sampler's first. Below 1 is a run's explicit trust in its samplers: a sampler never caught
    # has about (1 - f) / f groups trained unproven before its first check (a suspect's are all
    # checked). Groups of the version the trainer holds are proved by the step's own forward (with
    # publish_dtype float32: the weights it trains are those the samplers run). A sampler with
    # more than quarantine_after forgeries or reward mismatches is quarantined.
    verify_fraction: float = Field(1.0, ge=0, le=1)
    verify_tolerance: float = Field(0.01, gt=0)  # between fp32 samplers and an fp32 trainer
    # Where either side computes in bf16/fp16: honest SmolLM2 groups measured up to 0.33 (docs/operations.md).
    verify_tolerance_16bit: float = Field(0.5, gt=0)
    # sampling.noise = "keyed": how far (in logits / temperature) a sampled token may fall short of
    # the noisy argmax the trainer recomputes, for the engines' numeric differences; a token past it
    # is a forgery. Honest margins measured (bench/proof.py, results/proof-*.json): 0 with fp32 on both
    # sides; with a bf16 sampler 0.006 on the tiny model (10,000 completions), 0.23 on SmolLM2 (64; 0.33 in 768 on an H100).
    verify_margin: float = Field(0.01, gt=0)  # between fp32 samplers and an fp32 trainer
    verify_margin_16bit: float = Field(0.5, gt=0)  # where either side computes in bf16/fp16
    # algorithm.router_replay = "replay": how far (in router logits) a recorded expert may lie below
    # the trainer's own k-th choice (echo/trust/routing.py::routing_gap); a group past it is forged_routing.
    # Honest bf16 samplers measured at most 0.004 on tiny-moe (bench/moe.py, results/moe.json), where
    # 96% of made-up choices lie past 0.05. A model with larger router logits rounds more: measure
    # yours with bench/moe.py before lowering it.
    verify_routing_margin: float = Field(0.05, gt=0)
    quarantine_after: int = Field(3, ge=0)  # offences tolerated before quarantine (0: none)
    # Selective delivery (echo/fleet/grants.py): a sampler that keeps back the groups it dislikes biases
    # training without forging anything. An honest one delivers its slots in order and loses them
    # only to faults (a crash or restart loses its call in flight, sampling.prompts_per_call
    # slots); one with more than undelivered_share of its last undelivered_window slots undelivered
    # is struck. Honest samplers under faults measured: docs/security.md.
    undelivered_share: float = Field(0.125, gt=0, le=1)
    undelivered_window: int = Field(64, ge=1)  # a sampler's last ended slots that undelivered_share reads
    # The verifiers run in a child process with this budget per completion (a sampler chooses
    # what they read): past it, the group is rejected as verifier_budget, a strike.
    score_budget_s: float = Field(5.0, gt=0)  # wall-clock seconds
    score_memory_mb: float = Field(1024.0, gt=0)  # memory above the scoring process's own at start
    keep_versions: int = Field(3, ge=1)  # Versions kept in the weights bucket and run dir; older ones are deleted.
    # Seconds an older version stays in the bucket after a newer one came out, past keep_versions:
    # a sampler has at least that long to fetch a version. Raise it for slow links or full weights
    # (it costs bucket space when steps are fast).
    keep_versions_s: float = Field(120.0, ge=0)
    shard_mb: float = Field(64.0, gt=0)  # published weights are split into objects of about this size
    # What published weights are stored as (samplers cast on load): bf16 halves the bytes on the
    # wire, at a rounding of the trained fp32 weights that the importance weights correct for.
    publish_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Full weights go as a sparse delta against the version before (echo/weights/delta.py; in bf16 most
    # elements keep their bits from one step to the next), with the whole weights (an anchor)
    # every delta_every versions, and whenever a delta would be more than delta_max_share of the
    # whole. 0: always whole. A LoRA adapter always goes whole.
    delta_every: int = Field(10, ge=0, le=MAX_CHAIN)
    delta_max_share: float = Field(0.5, gt=0, le=1)  # a larger delta goes whole: it would save too little
    ack_wait_s: float = Field(60.0, gt=0)  # a stalled trainer's unacked groups come back after this
    threads: int = Field(0, ge=0)  # torch threads; 0 leaves torch's default
    # A pause per step on top of training it: a slower learner, for tests and benchmarks of the
    # scheduler (the tiny model's step is short and varies with the machine's load).
    throttle_s: float = Field(0.0, ge=0)


class SamplerConfig(_Section):
    count: int = Field(2, ge=1)  # samplers `echo-rl up` starts
    # auto: vLLM where it is installed and a CUDA device is present, else transformers (echo/engines/);
    # hf-paged: transformers' continuous batching over a paged cache (whole completions, as vllm).
    engine: Literal["auto", "hf", "hf-paged", "vllm", "mlx"] = "auto"
    # engine = "mlx": the model split over this many processes by mlx-lm's pipeline (each holds a
    # share of the layers, in proportion to its memory: what the split buys is memory); rank 0 is
    # the sampler. On this box, started by it; on several, named by `hostfile`.
    ranks: int = Field(1, ge=1, le=64)
    # MLX's ring hostfile (JSON: one ["host:port"] a rank, rank 0 first) for ranks on several
    # machines, each started there with `echo-rl rank` (docs/operations.md); "": all on this box.
    hostfile: str = ""
    # The memory this rank offers the model's layers, in GB; 0: measured (a Mac's recommended
    # working set, else the machine's physical memory).
    memory_gb: float = Field(0.0, ge=0)
    # A wait on the other ranks (a forward through their layers, a collective) longer than this:
    # a rank hung. The sampler then starts its ranks again (workers/sampler/ranks.py).
    rank_timeout_s: float = Field(60.0, gt=0)
    threads: int = Field(0, ge=0)  # torch threads; 0 leaves torch's default
    heartbeat_s: float = Field(5.0, gt=0)  # how often a sampler writes its status to the run's KV
    # What this machine costs per hour (the scheduler's input, any currency): its own, never
    # taken from the trainer's config (echo/config/edge.py).
    cost_per_hour: float = Field(0.0, ge=0)
    # Seconds of pause per group generated, and between chunks: a slower machine, for tests and
    # benchmarks of the scheduler. Its own, like cost_per_hour.
    throttle_s: float = Field(0.0, ge=0)
    rate_window_s: float = Field(60.0, gt=0)  # the rates in its heartbeat cover its calls of this long
    entry_ttl_s: int = Field(30, ge=1)  # its registry entry expires this long after its last heartbeat


class SchedulerConfig(_Section):
    # ECHO-2's cost-aware activation (docs/operations.md, Scheduling): the trainer keeps on standby the samplers
    # that cheaper ones make unnecessary for `target_utilisation`. Off: every sampler takes work.
    enabled: bool = False
    target_utilisation: float = Field(0.9, gt=0, le=1)  # the learner's busy share to reach at the lowest cost
    every_s: float = Field(5.0, gt=0)  # how often the trainer reads the registry
    drift: float = Field(0.25, ge=0)  # a sampler's measured rate moving by more than this fraction: choose again
    # Choosing again keeps the active set while it still reaches the target at no more than
    # (1 + switch_margin) times the cheapest set's cost per step: no swapping on a near tie.
    switch_margin: float = Field(0.1, ge=0)


class NatsConfig(_Section):
    url: str = "nats://127.0.0.1:4222"  # `echo-rl up` replaces it with its embedded server's
    # The hub's JetStream domain (its server config's `jetstream { domain: ... }`): samplers
    # behind a relay reach the hub's streams through it. "" for a hub without a domain.
    hub_domain: str = HUB_DOMAIN
    # A secured broker (`echo-rl secure init`): this client's nkey seed file and the CA that
    # signed the server's certificate. Local to each machine: never sent to the broker.
    creds: str = ""
    tls_ca: str = ""  # the CA file, with creds
    # A sampler behind a secured relay: read weights from the relay at this URL, everything
    # else at `url` (the hub). Local to each machine too.
    weights_url: str = ""
    # Copies the trainer makes of each of the run's streams and buckets on a cluster's nodes
    # (3 survives one node down).
    replicas: int = Field(1, ge=1, le=5)
    # The rollout history's size limit, each of its two streams; past it the oldest go first (0: none).
    rollouts_max_gb: float = Field(0.0, ge=0)
    rollouts_max_age_h: float = Field(0.0, ge=0)  # the rollout history's age limit, in hours (0: none)
    # What one sampler may keep in each of the rollout streams: past it, its own oldest messages go first (its
    # unread ones counted as evicted), no other sampler's. 4 GB is its newest 16,384 groups (of at
    # most 256 KiB each, larger ones in parts) and 512 parts. 0: no limit, for a fleet you trust.
    sampler_quota_gb: float = Field(4.0, ge=0)

    def storage(self) -> Storage:
        return Storage(replicas=self.replicas, rollouts_max_bytes=int(self.rollouts_max_gb * 2**30) or -1,
                       rollouts_max_age_s=self.rollouts_max_age_h * 3600,
                       sampler_max_bytes=int(self.sampler_quota_gb * 2**30) or -1)

    @model_validator(mode="after")
    def _a_quota_is_at_most_half_the_history(self):
        # The stream keeps its newest bytes: one sampler's flood of its whole quota then leaves
        # the other half to the others' newest (unread) groups.
        if self.rollouts_max_gb and self.sampler_quota_gb * 2 > self.rollouts_max_gb:
            raise ValueError(f"nats.sampler_quota_gb {self.sampler_quota_gb} is more than half of "
                             f"nats.rollouts_max_gb {self.rollouts_max_gb}: one sampler's flood could evict "
                             f"the others' unread groups")
        return self

    @model_validator(mode="after")
    def _creds_come_with_a_ca(self):
        if bool(self.creds) != bool(self.tls_ca):
            raise ValueError("nats.creds and nats.tls_ca go together (a secured broker speaks TLS only)")
        return self


# What each algorithm.preset sets (echo/train/algorithms/; docs/algorithms.md). A field given beside
# the preset wins over it.
PRESETS: dict[str, dict[str, Any]] = {
    # TRL's GRPOConfig defaults: loss_type "dapo" (a token mean over the batch), rewards scaled by
    # the group's std, a symmetric clip of 0.2.
    "default": {"loss_aggregation": "token_mean", "scale_rewards": "group", "clip_low": 0.2, "clip_high": 0.2,
                "ratio_level": "token", "mask_truncated": False, "dynamic_sampling": False},
    # GRPO as published (DeepSeekMath): each completion's token mean, averaged over completions.
    "grpo": {"loss_aggregation": "sequence_mean", "scale_rewards": "group", "clip_low": 0.2, "clip_high": 0.2,
             "ratio_level": "token", "mask_truncated": False, "dynamic_sampling": False},
    # Dr. GRPO: no std scaling, no length normalisation (a constant: completions x max_new_tokens).
    "dr_grpo": {"loss_aggregation": "constant", "scale_rewards": "none", "clip_low": 0.2, "clip_high": 0.2,
                "ratio_level": "token", "mask_truncated": False, "dynamic_sampling": False},
    # DAPO: clip-higher, a token mean over the batch, truncated completions masked, and dynamic
    # sampling (groups with no reward spread replaced). Its overlong reward shaping is not here.
    "dapo": {"loss_aggregation": "token_mean", "scale_rewards": "group", "clip_low": 0.2, "clip_high": 0.28,
             "ratio_level": "token", "mask_truncated": True, "dynamic_sampling": True},
    # GSPO: one length-normalised ratio per completion, clipped at the paper's 3e-4 / 4e-4.
    "gspo": {"loss_aggregation": "sequence_mean", "scale_rewards": "group", "clip_low": 3e-4, "clip_high": 4e-4,
             "ratio_level": "sequence", "mask_truncated": False, "dynamic_sampling": False},
}


class AlgorithmConfig(_Section):
    # A recipe by name: default (TRL's GRPOConfig defaults), grpo, dr_grpo, dapo or gspo; each sets
    # the fields PRESETS lists (docs/algorithms.md), and a field set beside it wins.
    preset: Literal["default", "grpo", "dr_grpo", "dapo", "gspo"] = "default"
    # How the per-token losses add up (TRL's loss_type): token_mean over the batch's tokens (dapo),
    # sequence_mean (each completion's token mean, over completions: grpo), constant (over
    # completions x sampling.max_new_tokens: dr_grpo).
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    # Advantages: the reward less its group's mean, divided by the group's std, the batch's, or none.
    scale_rewards: Literal["group", "batch", "none"] = "group"
    clip_low: float = Field(0.2, gt=0, lt=1)  # the ratio is clipped below at 1 - clip_low (TRL's epsilon)
    clip_high: float = Field(0.2, gt=0)  # and above at 1 + clip_high (TRL's epsilon_high: DAPO's clip-higher)
    # The PPO ratio pi / pi_old per token, or per completion (GSPO: exp of the mean log-ratio);
    # TRL's importance_sampling_level.
    ratio_level: Literal["token", "sequence"] = "token"
    # Optimizer steps on each batch (TRL's num_iterations): pi_old is frozen at the batch's first,
    # so from the second on the ratio and the clip act. The rollout correction still reads the
    # sampler's mu against that pi_old.
    num_iterations: int = Field(1, ge=1, le=16)
    # Completions stopped by sampling.max_new_tokens left out of the loss (their tokens still
    # count in the denominators, as TRL's mask_truncated_completions).
    mask_truncated: bool = False
    # DAPO's dynamic sampling: a group whose rewards are all equal (no advantage) is not trained;
    # the step asks for another in its place, at most dynamic_sampling_max a step (each a grant
    # and its generation: counted as filtered_no_signal), then trains on what it has.
    dynamic_sampling: bool = False
    dynamic_sampling_max: int = Field(32, ge=0)  # groups set aside a step at most, before it trains on what it has
    kl_coef: float = Field(0.0, ge=0)  # KL penalty to the base model (the adapter switched off); 0: none (TRL's beta)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators of KL(policy || reference); TRL's is k3
    # Rollout correction, as verl's algorithm.rollout_correction (echo/train/algorithms/corrections.py):
    # importance weights pi_old / mu truncated at rollout_is_threshold, per token (token TIS) or
    # per completion (sequence TIS: the product of its ratios); off trains stale rollouts as if
    # fresh (the ratios still measured): a baseline for studies.
    rollout_is: Literal["off", "token", "sequence"] = "token"
    rollout_is_threshold: float = Field(2.0, ge=1.0)  # the importance weights' cap (verl's name)
    # Rejection: weight 0 for tokens (token: IcePop) or completions (sequence: MIS, on the product
    # of ratios; geometric: on their geometric mean) whose ratio lies outside
    # [rollout_rs_threshold_lower, rollout_rs_threshold], or (k3) completions whose mean k3
    # estimate of KL(mu || pi_old) is above rollout_rs_k3_threshold.
    rollout_rs: Literal["off", "token", "sequence", "geometric", "k3"] = "off"
    rollout_rs_threshold: float = Field(2.0, gt=0)  # a ratio above it is rejected (IcePop's paper: 5)
    rollout_rs_threshold_lower: float = Field(0.5, ge=0)  # a ratio below it is rejected (IcePop's: 0.5; MIS: 0)
    rollout_rs_k3_threshold: float = Field(0.01, gt=0)  # k3: a completion's mean estimate above it is rejected
    # A mixture of experts' routing (echo/trust/routing.py): "replay" has the samplers record the experts
    # each token went to and the trainer's forwards (pi_old, pi_theta, the proof) send it to the
    # same ones, so that a 16-bit sampler's near-ties in the router do not become ratios far from 1
    # (verl's and ROLL's R3). Needs an MoE model and sampler.engine "hf" or "hf-paged"; costs bytes a token
    # on the wire (docs/operations.md). "off": each side routes on its own.
    router_replay: Literal["off", "replay"] = "off"

    @model_validator(mode="before")
    @classmethod
    def _preset_first(cls, data: Any) -> Any:
        """The preset's fields, under those given beside it."""
        if isinstance(data, dict) and data.get("preset", "default") in PRESETS:
            return {**PRESETS[data.get("preset", "default")], **data}
        return data

    @model_validator(mode="after")
    def _a_consistent_objective(self):
        if self.ratio_level == "sequence" and self.loss_aggregation != "sequence_mean":
            raise ValueError(f"algorithm.ratio_level = \"sequence\" needs loss_aggregation = \"sequence_mean\" (GSPO): "
                             f"with {self.loss_aggregation!r} a completion's one ratio weighs by its length")
        if self.num_iterations > 1 and self.rollout_is == "off" and self.rollout_rs == "off":
            raise ValueError("algorithm.num_iterations > 1 needs a rollout correction (rollout_is or rollout_rs): the "
                             "ratio's anchor pi_old is the trainer's, and nothing would correct the samplers' mu to it")
        if self.rollout_rs_threshold_lower > self.rollout_rs_threshold:
            raise ValueError(f"algorithm.rollout_rs_threshold_lower ({self.rollout_rs_threshold_lower}) is above "
                             f"rollout_rs_threshold ({self.rollout_rs_threshold}): every ratio would be rejected")
        return self


class EchoConfig(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    lora: LoraConfig = LoraConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampler: SamplerConfig = SamplerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    nats: NatsConfig = NatsConfig()

    @model_validator(mode="after")
    def _an_evaluation_needs_prompts(self):
        if self.run.eval_every and not self.run.eval_prompts:
            raise ValueError("run.eval_every needs run.eval_prompts > 0: the held-out prompts each evaluation scores")
        return self

    @model_validator(mode="after")
    def _kl_needs_a_reference(self):
        if not self.lora.enabled and self.algorithm.kl_coef > 0:
            raise ValueError("algorithm.kl_coef > 0 needs lora.enabled: the KL reference is the base model with "
                             "the adapter switched off, and full-weight mode keeps no second copy")
        return self

    @model_validator(mode="after")
    def _dead_means_several_missed_heartbeats(self):
        if self.sampler.entry_ttl_s <= self.sampler.heartbeat_s:
            raise ValueError(f"sampler.entry_ttl_s ({self.sampler.entry_ttl_s}) must be longer than sampler.heartbeat_s "
                             f"({self.sampler.heartbeat_s}): a live sampler's entry would expire between beats")
        if self.trainer.sampler_dead_after_s < 2 * self.sampler.heartbeat_s:
            raise ValueError(f"trainer.sampler_dead_after_s ({self.trainer.sampler_dead_after_s}) must be at least "
                             f"twice sampler.heartbeat_s ({self.sampler.heartbeat_s}): live samplers would be "
                             "declared dead between two beats")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.id

    @property
    def staleness_bound(self) -> int:
        """The staleness bound the trainer applies: sequential mode trains on its current version only."""
        return 0 if self.run.mode == "sequential" else self.trainer.max_staleness

    @property
    def begun_within(self) -> int:
        """How many versions back a group's first tokens may have been sampled: the staleness
        bound, or with partial rollouts its window once more (tokens older than the bound are
        not trained, but the proof of sampling reads them under their versions: it keeps these)."""
        bound = self.staleness_bound
        return 2 * bound + 1 if self.sampling.chunk_tokens else bound

    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump())


def _parse_value(text: str) -> Any:
    """Parse an override's value as TOML (numbers, booleans, lists); plain words stay strings, and
    so do the bare words of a list, as Hydra reads them: [tensorboard, wandb]."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if text.startswith("[") and text.endswith("]") and "[" not in text[1:-1]:
            return [_parse_value(item.strip()) for item in text[1:-1].split(",") if item.strip()]
        return text


def apply_override(data: dict, assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    *sections, leaf = key.strip().split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {section} is not a section")
    node[leaf] = _parse_value(value.strip())


def read_config_file(path: str | Path) -> dict:
    """A config file's fields: TOML, or YAML by its extension (.yaml, .yml)."""
    path = Path(path)
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if yaml_file:
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path}: not valid YAML: {e}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {path}: not valid TOML ({e}); a YAML config ends in .yaml or .yml") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: its top level must be sections (run, model, trainer, ...), not a "
                          f"{type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> EchoConfig:
    data = read_config_file(path) if path is not None else {}
    for assignment in overrides:
        apply_override(data, assignment)
    return validate_config(data)


# verl's and TRL's names for what echo-rl calls otherwise: an unknown field among them is answered
# with echo-rl's key (not taken as an alias: one name a meaning, and some differ in unit).
FOREIGN_KEYS = {
    # verl's (Hydra's dotted keys)
    "data.train_files": "task.name=\"dataset\" with task.params.path",
    "data.val_files": "task.params.val_path",
    "data.prompt_key": "task.params.prompt",
    "data.train_batch_size": "trainer.groups_per_step (prompts a step)",
    "data.max_response_length": "sampling.max_new_tokens",
    "trainer.total_training_steps": "run.steps",
    "trainer.total_epochs": "run.steps (echo-rl counts steps)",
    "trainer.test_freq": "run.eval_every",
    "trainer.val_before_train": "run.eval_before",
    "trainer.logger": "run.trackers",
    "trainer.project_name": "run.id",
    "trainer.experiment_name": "run.id",
    "trainer.default_local_dir": "run.dir",
    "actor_rollout_ref.model.path": "model.name",
    "actor_rollout_ref.actor.optim.lr": "trainer.lr",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_low and algorithm.clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_high",
    "actor_rollout_ref.actor.ppo_epochs": "algorithm.num_iterations",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_aggregation",
    "actor_rollout_ref.rollout.n": "sampling.group_size",
    "actor_rollout_ref.rollout.temperature": "sampling.temperature",
    "actor_rollout_ref.rollout.response_length": "sampling.max_new_tokens",
    "algorithm.adv_estimator": "algorithm.preset (\"grpo\", \"dr_grpo\", \"dapo\", \"gspo\")",
    # TRL's (GRPOConfig's fields)
    "model_name_or_path": "model.name",
    "output_dir": "run.dir",
    "max_steps": "run.steps",
    "seed": "run.seed",
    "learning_rate": "trainer.lr",
    "num_generations": "sampling.group_size",
    "max_completion_length": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_low",
    "epsilon_high": "algorithm.clip_high",
    "loss_type": "algorithm.preset, or algorithm.loss_aggregation",
    "num_iterations": "algorithm.num_iterations",
    "scale_rewards": "algorithm.scale_rewards",
    "mask_truncated_completions": "algorithm.mask_truncated",
    "importance_sampling_level": "algorithm.ratio_level",
    "report_to": "run.trackers",
    "log_completions": "run.log_completions (run.samples_per_step of them)",
    "eval_strategy": "run.eval_every",
}


def known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model`, its sections' too, as prefix + section.key."""
    keys = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys += known_keys(kind, f"{prefix}{name}.")
        elif dataclasses.is_dataclass(kind):  # a section validated as a dataclass (a fleet file's)
            keys += [f"{prefix}{name}.{field.name}" for field in dataclasses.fields(kind)]
        else:
            keys.append(prefix + name)
    return keys


def _unknown(path: str, value, known: list[str]) -> str:
    """An unknown field's line: echo-rl's key for verl's or TRL's name, else the nearest `known`."""
    if isinstance(value, dict):  # an unknown section: its keys, each named whole
        return "; ".join(_unknown(f"{path}.{key}", inner, known) for key, inner in value.items())
    if path in FOREIGN_KEYS:
        return f"{path}: unknown field (verl's or TRL's name): echo-rl's is {FOREIGN_KEYS[path]}"
    close = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
    if not close:  # the key right, in another section (or none)
        leaf = difflib.get_close_matches(path.rsplit(".", 1)[-1], [key.rsplit(".", 1)[-1] for key in known], n=1,
                                         cutoff=0.8)
        close = [key for key in known if leaf and key.rsplit(".", 1)[-1] == leaf[0]][:2]
    return f"{path}: unknown field" + (f"; did you mean {' or '.join(close)}?" if close else "")


def format_errors(error: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line for a config's errors; with `model` (what was validated), an unknown field is
    answered with the key it may have meant."""
    known = known_keys(model, prefix) if model is not None else []
    lines = []
    for err in error.errors():
        field = prefix + ".".join(str(p) for p in err["loc"])
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's, a dataclass's
            lines.append(_unknown(field, err.get("input"), known))
        else:
            lines.append(f"{field}: {err['msg']}")
    return "; ".join(lines)


def upgraded(data: dict) -> dict:
    """A config of an earlier release in today's fields: the objective's keys moved from trainer
    to algorithm (clip_eps to clip_low and clip_high; is_level "sequence", which also left out
    completions whose geometric-mean ratio was beyond is_cap, to rollout_rs "geometric")."""
    trainer = data.get("trainer")
    if not isinstance(trainer, dict) or not {"clip_eps", "kl_coef", "is_level", "is_cap"} & trainer.keys():
        return data
    trainer, algorithm = dict(trainer), dict(data.get("algorithm") or {})
    if "clip_eps" in trainer:
        algorithm.setdefault("clip_low", trainer["clip_eps"])
        algorithm.setdefault("clip_high", trainer.pop("clip_eps"))
    if "kl_coef" in trainer:
        algorithm.setdefault("kl_coef", trainer.pop("kl_coef"))
    cap = trainer.pop("is_cap", 2.0)
    algorithm.setdefault("rollout_is_threshold", cap)
    level = trainer.pop("is_level", "token")
    algorithm.setdefault("rollout_is", "off" if level == "off" else "token")
    if level == "sequence":
        algorithm |= {"rollout_rs": "geometric", "rollout_rs_threshold": cap, "rollout_rs_threshold_lower": 1 / cap}
    return {**data, "trainer": trainer, "algorithm": algorithm}


def validate_config(data: dict) -> EchoConfig:
    try:
        return EchoConfig.model_validate(upgraded(data))
    except ValidationError as e:
        raise ConfigError("invalid config: " + format_errors(e, model=EchoConfig)) from None
