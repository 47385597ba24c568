"""The trainer's model on several ranks (workers/trainer/model.py): gloo ranks on the CPU,
FSDP2-sharded, each running its share of a step's passes, end with the policy one process gets;
a checkpoint written by 2 ranks resumes on 2 ranks or in one process."""

import copy
import gc
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from echo.model.loading import load_model
from echo.model.policy import make_policy
from echo.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from echo.train.learner import (
    Batch,
    Forward,
    Rewarded,
    make_optimizer,
    merge_stats,
    rank_passes,
    step_passes,
    train_step,
)
from echo.trust.routing import group_routing, recorded, routing_shape
from echo.weights.shards import policy_tensors
from echo.wire.messages import Routing
from streams.server import free_port
from tests.conftest import tiny_config
from tests.groups import honest_group
from workers.trainer.model import leave, shard

pytestmark = pytest.mark.slow
STEPS = 3
# An empty completion (EOS alone) makes a pass of one-token completions.
TEXTS = ["\\boxed{5}", "no idea at all, sorry", "", "\\boxed{999} because"]


def _start(tmp_path, lora: bool, model: str = "tiny"):
    """The same config, batch and start in every process: 3 groups in micro-batches, so that
    2 ranks get different numbers of passes (one runs an empty pass); KL on with LoRA."""
    budget = len(honest_group(12).prompt_token_ids) + 40
    moe = model == "tiny-moe"  # its routing replayed, as a sampler of these weights recorded it
    cfg = tiny_config(tmp_path, model={"name": model}, trainer={"micro_batch_tokens": budget}, lora={"enabled": lora},
                      algorithm={"kl_coef": 0.1 if lora else 0.0, "router_replay": "replay" if moe else "off"})
    batch = Batch([Rewarded(honest_group(12 + i, texts=TEXTS), [float((i + j) % 2) for j in range(4)])
                   for i in range(3)])
    base, tokenizer = load_model(model)
    torch.manual_seed(0)  # peft draws the adapter's initial values
    policy = make_policy(base, cfg.lora)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    if moe:
        batch = Batch([Rewarded(r.group.replaced(routing=_recorded(policy, r.group)), r.rewards) for r in batch.groups])
    return cfg, batch, policy, tokenizer.pad_token_id


def _recorded(policy, group) -> Routing:
    """The group's routing as the policy's forward over each completion chose it."""
    rows = []
    for completion in group.completions:
        with torch.no_grad(), recorded(policy) as calls:
            policy(input_ids=torch.tensor([[*group.prompt_token_ids.tolist(), *completion.token_ids.tolist()]]))
        ids = torch.stack([layer[0] for layer in calls], 1).numpy().astype(np.uint16)
        ids[-1] = 0  # the last token is never an input
        rows.append(ids)
    return group_routing(rows, len(group.prompt_token_ids), routing_shape(policy))


def _train(policy, cfg, batch, pad_id, rank=0, world=1, steps=STEPS, optimizer=None):
    optimizer = optimizer or make_optimizer(policy, cfg)
    forward = Forward.of(policy, cfg, pad_id)
    stats = [train_step(forward, optimizer, batch, rank=rank, world=world) for _ in range(steps)]
    return optimizer, stats


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def _rank(rank: int, world: int, port: int, tmp_path, lora: bool, model: str) -> None:
    _join(rank, world, port)
    cfg, batch, policy, pad_id = _start(tmp_path, lora, model)
    shard(policy)
    _, stats = _train(policy, cfg, batch, pad_id, rank, world)
    parts = [None] * world
    dist.all_gather_object(parts, stats[0])
    tensors = policy_tensors(policy)  # gathered whole: a collective
    if rank == 0:
        torch.save({"tensors": tensors, "stats": merge_stats(parts)}, tmp_path / "ranks.pt")
    del policy  # its FSDP state holds the process group: released before the group is destroyed
    gc.collect()
    leave()


# Full-weight mode on the mixture of experts: its attention, norms and embeddings are the dense
# model's kinds, and its stacked experts and routers are sharded and trained as well, its routing
# replayed.
@pytest.mark.parametrize("lora, model", [(True, "tiny"), (False, "tiny-moe")], ids=["lora", "full-moe"])
def test_two_ranks_train_what_one_process_does(tmp_path, lora, model):
    """3 steps on a fixed batch of 3 groups: 2 FSDP2 ranks, each its share of the passes, against
    one process with all of them. Same trained tensors within 1e-6 (fp32 reduction order), and
    the ranks' merged statistics are the whole step's; and training moved them."""
    cfg, batch, _, _ = _start(tmp_path, lora, model)
    passes = step_passes(batch, cfg.trainer.micro_batch_tokens)
    assert len(passes) % 2 == 1 and rank_passes(passes, 1, 2)[-1] is None  # rank 1 runs an empty pass
    mp.spawn(_rank, args=(2, free_port(), tmp_path, lora, model), nprocs=2)
    cfg, batch, policy, pad_id = _start(tmp_path, lora, model)
    before = copy.deepcopy(policy_tensors(policy))
    _, stats = _train(policy, cfg, batch, pad_id)
    one, two = policy_tensors(policy), torch.load(tmp_path / "ranks.pt")
    assert one.keys() == two["tensors"].keys()
    assert all(torch.allclose(one[k], two["tensors"][k], atol=1e-6, rtol=0) for k in one)
    assert any(not torch.allclose(one[k], before[k], atol=1e-4) for k in one)
    for key in ("loss", "kl", "entropy", "is_ratio_mean", "is_masked_fraction", "grad_norm", "tokens", "reward_mean"):
        assert two["stats"][key] == pytest.approx(stats[0][key], abs=1e-6), key


def _rank_resuming(rank: int, world: int, port: int, tmp_path, resume: bool) -> None:
    """Train 2 steps and checkpoint (resume False), or load that checkpoint and train 1 more.
    One process (world 1) joins no process group: a plain trainer resuming."""
    if world > 1:
        _join(rank, world, port)
    cfg, batch, policy, pad_id = _start(tmp_path, lora=True)
    if resume:
        with torch.no_grad():  # not the checkpoint's weights: loading must replace them
            for p in policy.parameters():
                if p.requires_grad:
                    p.zero_()
    if world > 1:
        shard(policy)
    optimizer = make_optimizer(policy, cfg)
    path = tmp_path / "checkpoint.pt"
    if resume:
        assert load_checkpoint(path, policy, optimizer, rank) == TrainerState(step=2, version=2)
        _train(policy, cfg, batch, pad_id, rank, world, steps=1, optimizer=optimizer)
        tensors = policy_tensors(policy)
        if rank == 0:
            torch.save(tensors, tmp_path / "resumed.pt")
    else:
        _train(policy, cfg, batch, pad_id, rank, world, steps=STEPS - 1, optimizer=optimizer)
        rngs = [None] * world
        dist.all_gather_object(rngs, torch.get_rng_state())
        save_checkpoint(path, policy, optimizer, TrainerState(step=2, version=2), rngs, commit=rank == 0)
    if world > 1:
        del policy, optimizer  # as in _rank
        gc.collect()
        leave()


@pytest.mark.parametrize("resume_ranks", [2, 1])
def test_a_checkpoint_of_two_ranks_resumes_on_two_ranks_or_in_one_process(tmp_path, resume_ranks):
    """2 ranks train 2 steps and checkpoint (DCP: each rank its shards of the adapter and AdamW
    state); 2 ranks, or one plain process (DCP reshards), load it into a zeroed adapter and train
    the 3rd step: the adapter of 3 uninterrupted single-process steps, within 1e-6."""
    mp.spawn(_rank_resuming, args=(2, free_port(), tmp_path, False), nprocs=2)
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-000002"]
    if resume_ranks == 1:
        _rank_resuming(0, 1, None, tmp_path, True)
    else:
        mp.spawn(_rank_resuming, args=(2, free_port(), tmp_path, True), nprocs=2)
    cfg, batch, policy, pad_id = _start(tmp_path, lora=True)
    _train(policy, cfg, batch, pad_id)
    one, resumed = policy_tensors(policy), torch.load(tmp_path / "resumed.pt")
    assert all(torch.allclose(one[k], resumed[k], atol=1e-6, rtol=0) for k in one)
