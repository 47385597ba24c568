"""The trainer's model on one process or on several ranks (`torchrun --nproc-per-node N`).

Rank 0 is the trainer the run knows: it does all NATS I/O (collecting, scoring, acking,
publishing). The model work is `TrainerModel`'s: a step, a proof-of-sampling forward, a checkpoint,
gathering the weights to publish. Rank 0's call of each is first sent to the other ranks, which
wait in `TrainerModel.follow` and run the same method with the same arguments, so every rank reaches
the same collectives in the same order.

FSDP2 shards the model: `fully_shard` per decoder layer, then the root. Each rank runs its share
of a step's passes with the loss already divided by the whole step's tokens, so the step's
gradient is the *sum* of the ranks' gradients: FSDP's reduction must not average.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from peft import PeftModel
from torch.distributed.fsdp import FSDPModule, fully_shard

from echo.config import ConfigError, EchoConfig
from echo.model.devices import DTYPES, resolve_device, resolve_dtype
from echo.model.loading import base_model_digest, load_model
from echo.model.policy import make_policy
from echo.process.lifeline import die_with_parent
from echo.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from echo.train.learner import (
    Batch,
    ForgedInStep,
    Forward,
    HeldProof,
    make_optimizer,
    merge_stats,
    set_threads,
    train_step,
)
from echo.trust.proof import Checked, ProofSettings, SamplingProof, worst_checks
from echo.trust.routing import replayed_shape
from echo.weights.files import prune_weights, read_shards, weights_at, weights_file
from echo.weights.shards import shards_tensors, weights_kind, weights_shards
from echo.wire.messages import RolloutGroup

log = structlog.get_logger()

# The other ranks wait for rank 0's next call as long as rank 0 waits for rollouts: hours, if
# the samplers are gone. A rank that dies is noticed by torchrun, which stops them all.
CALL_WAIT = timedelta(days=30)


class Ranks:
    """This process's place among the trainer's ranks: rank 0 of 1 without torchrun."""

    def __init__(self, device_name: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = resolve_device(device_name)
        self.calls = None
        if self.world == 1:
            return
        die_with_parent()  # torchrun: killed, it would leave this rank training unsupervised
        if self.device.type == "cuda" and self.device.index is None:  # one GPU per rank of this node
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.calls = dist.new_group(backend="gloo", timeout=CALL_WAIT)  # Python objects, from the CPU

    def send(self, call) -> None:
        if self.world > 1:
            dist.broadcast_object_list([call], src=0, group=self.calls)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.calls)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order (on every rank)."""
        if self.world == 1:
            return [value]
        values = [None] * self.world
        dist.all_gather_object(values, value, group=self.calls)
        return values

    def close(self) -> None:
        if self.world > 1:
            leave()


def leave() -> None:
    """Leave the process group together: a rank that tears its group down while another still
    talks to it can abort (gloo: "terminate called without an active exception", seen once in
    CI at the end of a 2-rank test)."""
    dist.barrier()
    dist.destroy_process_group()


def decoder_layers(policy) -> torch.nn.ModuleList:
    model = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    return model.model.layers


def shard(policy) -> None:
    """FSDP2: each decoder layer, then the whole model (its embeddings and head), onto this
    rank's device."""
    for layer in decoder_layers(policy):
        fully_shard(layer)
    fully_shard(policy)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: see the module's docstring
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


@dataclass(frozen=True)
class Stepped:
    """What a step did: its statistics, or, where its own forward proved groups forged (group id
    -> why), those and no update."""

    stats: dict = field(default_factory=dict)
    forged: dict[str, str] = field(default_factory=dict)


def everywhere(method):
    """A TrainerModel method every rank runs: rank 0's call is sent to the other ranks first."""

    @functools.wraps(method)
    def call(self, *args):
        self.ranks.send((method.__name__, args))
        return method(self, *args)

    return call


class TrainerModel:
    """The policy (`module`: the nn.Module trained), its optimizer and its proof of sampling, on every
    rank; rank 0 calls."""

    def __init__(self, cfg: EchoConfig, ranks: Ranks):
        set_threads(cfg.trainer.threads)
        self.cfg, self.ranks = cfg, ranks
        self.compute_dtype = resolve_dtype(cfg.model.dtype, ranks.device)
        # What is trained stays fp32 (and so does its optimizer state): a LoRA adapter over a base
        # in compute_dtype, or in full-weight mode the whole model, forwarded under autocast. On
        # several ranks the model is read on the CPU and each rank keeps its shards on its device.
        load_on = ranks.device if ranks.world == 1 else torch.device("cpu")
        base, self.tokenizer = load_model(cfg.model.name, load_on, self.compute_dtype if cfg.lora.enabled else torch.float32)
        self.vocab_size = base.get_input_embeddings().num_embeddings
        self.context = getattr(base.config, "max_position_embeddings", None)  # tokens, prompt and completion
        # (layers, top_k, experts) where the run replays a mixture of experts' routing: every group carries it.
        self.routing = replayed_shape(base, cfg.model.name, cfg.algorithm.router_replay == "replay")
        # The adapter's initial values come from the run's seed: the same on every rank, and a
        # retrain (`echo-rl replay --retrain`) starts where the run started.
        with torch.random.fork_rng(devices=[ranks.device] if ranks.device.type == "cuda" else []):
            torch.manual_seed(cfg.run.seed)
            self.module = make_policy(base, cfg.lora)
        if ranks.world > 1:
            shard(self.module)
        self.kind = weights_kind(self.module)
        self.base_model = base_model_digest(cfg.model.name)  # what samplers check the weights are for
        self.optimizer = make_optimizer(self.module, cfg)
        self.checkpoint_path = cfg.run_dir / "checkpoint.pt"
        self.state = TrainerState()  # a fresh run's, until `resume` reads the checkpoint
        self.proof = SamplingProof(self.module, self.tokenizer.pad_token_id, ProofSettings.of(cfg, self.compute_dtype))
        self.forward = Forward.of(self.module, cfg, self.tokenizer.pad_token_id, self.compute_dtype)
        self.stop = threading.Event()  # set from rank 0's event loop: abandon the step (one process only)

    @everywhere
    def resume(self) -> None:
        """Read the run's checkpoint, if it has one. Only once this trainer holds the run's lease:
        another trainer (an orphan, one fenced out) prunes checkpoint folders as it saves."""
        state = load_checkpoint(self.checkpoint_path, self.module, self.optimizer, self.ranks.rank) or TrainerState()
        if state.base_model and state.base_model != self.base_model:  # e.g. a hub branch that moved between starts
            raise ConfigError(f"model.name {self.cfg.model.name!r} is base {self.base_model}, and this run's "
                              f"checkpoint was trained on base {state.base_model}: start the run on the model it "
                              f"began with (model.name in {self.cfg.run_dir / 'config.toml'})")
        state.base_model = self.base_model
        self.state = state
        recall_versions(self.proof, self.cfg.run_dir, state.version)

    @everywhere
    def train(self, batch: Batch, version: int | None = None) -> Stepped:
        """A step on the batch (echo/train/learner.py's train_step), on every rank; given the `version`
        it trains from, the groups that version sampled are proved by the step's own forward where
        the proof does (in_step; a retrain or a bench proves nothing). Returns the step's
        statistics, or the groups it proved forged and no update."""
        # On several ranks a step is never abandoned half way: the other ranks would wait in its
        # collectives. A stopping trainer's ranks are all stopped by torchrun instead.
        stop = self.stop if self.ranks.world == 1 else None
        held = None
        if self.proof.in_step and version is not None:
            held = HeldProof(version, self.proof.noise_key, functools.partial(self._judge_held, batch))
        try:
            stats = train_step(self.forward, self.optimizer, batch, stop, self.ranks.rank, self.ranks.world, held)
        except ForgedInStep as e:
            return Stepped(forged=e.forged)
        return Stepped(merge_stats(self.ranks.gather(stats)))

    def _judge_held(self, batch: Batch, checked: dict[str, Checked]) -> dict[str, str]:
        """Every rank's checks of the step's groups (each ran some of its passes), judged alike."""
        return self.proof.judged_in_step({r.group.group_id: r.group for r in batch.groups},
                                         worst_checks(self.ranks.gather(checked)))

    @everywhere
    def check_many(self, groups: list[RolloutGroup]) -> dict[str, Checked | None]:
        """Proof of sampling: each group's log-prob gap and token margin, a version's groups
        together (SamplingProof.check_many)."""
        return self.proof.check_many(groups)

    @everywhere
    def remember(self, version: int) -> None:
        self.proof.remember(version)

    @everywhere
    def save(self, state: TrainerState) -> None:
        rng_states = self.ranks.gather(torch.get_rng_state())
        save_checkpoint(self.checkpoint_path, self.module, self.optimizer, state, rng_states,
                        commit=self.ranks.rank == 0)

    @everywhere
    def write_weights(self, version: int) -> list[Path]:
        """The version's safetensors shards in the run directory (for publishing and `echo-rl
        eval`), gathered shard by shard on rank 0; the newest `trainer.keep_versions` are kept."""
        run_dir, tcfg = self.cfg.run_dir, self.cfg.trainer
        if self.ranks.rank == 0:
            (run_dir / "weights").mkdir(parents=True, exist_ok=True)
        files = []
        for index, data in enumerate(weights_shards(self.module, int(tcfg.shard_mb * 2**20), DTYPES[tcfg.publish_dtype])):
            if self.ranks.rank == 0:
                files.append(weights_file(run_dir, version, index))
                files[-1].write_bytes(data)
        if self.ranks.rank == 0:  # the one before (the next delta is against it), and those the proof keeps
            prune_weights(run_dir, version - max(tcfg.keep_versions, 2, self.proof.keep) + 1)
        return files

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's calls until it says it is done."""
        while (call := self.ranks.receive()) is not None:
            name, args = call
            getattr(TrainerModel, name).__wrapped__(self, *args)

    def close(self) -> None:
        """Rank 0, at the end: let the other ranks leave `follow`, and leave with them."""
        try:
            self.ranks.send(None)
            self.ranks.close()
        except (RuntimeError, dist.DistError) as e:  # a rank is gone already: torchrun stops the rest
            log.warning("trainer.ranks_gone", reason=repr(e))


def recall_versions(proof: SamplingProof, run_dir: Path, version: int) -> None:
    """The versions before `version` that the proof keeps, read back from the run's weights
    files: their groups, still in the stream, are proven after a restart as before it. One
    not on disk is not kept, and its groups are refused as unverifiable (no strike)."""
    for old in range(max(0, version - proof.keep + 1), version):
        try:
            files = weights_at(run_dir, old)
        except FileNotFoundError:
            continue
        proof.recall(old, shards_tensors(read_shards(files)))


def follow_rank_0(cfg: EchoConfig, ranks: Ranks) -> int:
    """The whole life of a rank other than 0."""
    try:
        model = TrainerModel(cfg, ranks)
        model.follow()
        ranks.close()
        return 0
    except Exception as e:
        log.exception("trainer.rank_failed", rank=ranks.rank, reason=repr(e))
        return 1
