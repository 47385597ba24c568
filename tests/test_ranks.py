"""The trainer's model on several ranks (workers/trainer_ranks.py): 2 gloo ranks on the CPU,
FSDP2-sharded, each training on its share of a fixed batch, end with the adapter one rank gets."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import get_peft_model_state_dict

from echo.learner import make_optimizer, train_step
from echo.models import load_model
from echo.policy import make_policy
from streams.server import free_port
from tests.conftest import tiny_config
from tests.test_referee import honest_group
from workers.trainer_ranks import gathered, load_sharded, rank_share, save_sharded, shard

pytestmark = pytest.mark.slow
STEPS = 3


def _start(tmp_path):
    """The same config, batch and non-zero adapter in every process."""
    cfg = tiny_config(tmp_path, trainer={"kl_coef": 0.1})
    texts = ["\\boxed{5}", "no idea at all, sorry", "\\boxed{999} because", "hm"]
    batch = [(honest_group(12 + i, texts=texts), [float((i + j) % 2) for j in range(4)]) for i in range(4)]
    base, tokenizer = load_model("tiny")
    policy = make_policy(base, cfg.lora)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return cfg, batch, policy, tokenizer.pad_token_id


def _train(policy, cfg, batch, pad_id, share=lambda b: b, steps=STEPS, optimizer=None):
    optimizer = optimizer or make_optimizer(policy, cfg)
    tokens = sum(len(c.token_ids) for g, _ in batch for c in g.completions)
    for _ in range(steps):
        train_step(policy, optimizer, share(batch), cfg, pad_id, normalizer=tokens)
    return optimizer


def _rank(rank: int, world: int, port: int, tmp_path, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg, batch, policy, pad_id = _start(tmp_path)
    shard(policy)
    _train(policy, cfg, batch, pad_id, lambda b: rank_share(b, rank, world))
    adapter = gathered(get_peft_model_state_dict(policy))
    if rank == 0:
        torch.save(adapter, out)
    dist.destroy_process_group()


def test_two_ranks_train_the_adapter_one_rank_does(tmp_path):
    """3 steps on a fixed batch of 4 groups (KL on): 2 FSDP2 ranks, 2 groups each, against one
    process with all 4. Same adapter within 1e-6 (fp32 reduction order); and it moved."""
    mp.spawn(_rank, args=(2, free_port(), tmp_path, tmp_path / "two.pt"), nprocs=2)
    cfg, batch, policy, pad_id = _start(tmp_path)
    before = copy.deepcopy(get_peft_model_state_dict(policy))
    _train(policy, cfg, batch, pad_id)
    one, two = get_peft_model_state_dict(policy), torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys()
    assert all(torch.allclose(one[k], two[k], atol=1e-6, rtol=0) for k in one)
    assert any(not torch.allclose(one[k], before[k], atol=1e-4) for k in one)


def _rank_resuming(rank: int, world: int, port: int, tmp_path, out, resume: bool) -> None:
    """Train 2 steps and checkpoint (resume False), or load that checkpoint and train 1 more."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg, batch, policy, pad_id = _start(tmp_path)
    if resume:
        with torch.no_grad():  # not the checkpoint's weights: loading must replace them
            for p in policy.parameters():
                if p.requires_grad:
                    p.zero_()
    shard(policy)
    optimizer = make_optimizer(policy, cfg)
    share = lambda b: rank_share(b, rank, world)  # noqa: E731
    if resume:
        load_sharded(tmp_path / "dcp", policy, optimizer)
        _train(policy, cfg, batch, pad_id, share, steps=1, optimizer=optimizer)
        adapter = gathered(get_peft_model_state_dict(policy))
        if rank == 0:
            torch.save(adapter, out)
    else:
        _train(policy, cfg, batch, pad_id, share, steps=STEPS - 1, optimizer=optimizer)
        save_sharded(tmp_path / "dcp", policy, optimizer)
    dist.destroy_process_group()


@pytest.mark.parametrize("resume_ranks", [2, 1])
def test_a_sharded_checkpoint_resumes_on_the_same_or_another_number_of_ranks(tmp_path, resume_ranks):
    """2 ranks train 2 steps and write a distributed checkpoint (adapter and AdamW state); 2 ranks,
    or 1 (DCP reshards), load it into a zeroed adapter and train the 3rd step: the adapter of 3
    uninterrupted single-process steps, within 1e-6."""
    mp.spawn(_rank_resuming, args=(2, free_port(), tmp_path, None, False), nprocs=2)
    mp.spawn(_rank_resuming, args=(resume_ranks, free_port(), tmp_path, tmp_path / "resumed.pt", True),
             nprocs=resume_ranks)
    cfg, batch, policy, pad_id = _start(tmp_path)
    _train(policy, cfg, batch, pad_id)
    one, resumed = get_peft_model_state_dict(policy), torch.load(tmp_path / "resumed.pt")
    assert all(torch.allclose(one[k], resumed[k], atol=1e-6, rtol=0) for k in one)
