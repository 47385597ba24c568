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
from workers.trainer_ranks import gathered, rank_share, shard

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


def _train(policy, cfg, batch, pad_id, share=lambda b: b) -> None:
    optimizer = make_optimizer(policy, cfg)
    tokens = sum(len(c.token_ids) for g, _ in batch for c in g.completions)
    for _ in range(STEPS):
        train_step(policy, optimizer, share(batch), cfg, pad_id, normalizer=tokens)


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
