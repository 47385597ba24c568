"""The trainer's model over several ranks (torchrun): FSDP2 shards it, each rank trains on its
share of a step's groups, and the gradients add up to the one-rank step.

Each rank's loss is already divided by the whole step's token count (train_step's `normalizer`),
so the step's gradient is the *sum* of the ranks' gradients: FSDP's reduction must not average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from peft import PeftModel
from torch.distributed.fsdp import FSDPModule, fully_shard


def init_ranks(device: torch.device) -> tuple[int, int]:
    """Join the process group torchrun describes (its env vars): NCCL on CUDA, gloo on the CPU.
    Returns (rank, world size)."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def decoder_layers(policy) -> torch.nn.ModuleList:
    model = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    return model.model.layers


def shard(policy) -> None:
    """FSDP2: each decoder layer, then the whole model (its embeddings and head)."""
    for layer in decoder_layers(policy):
        fully_shard(layer)
    fully_shard(policy)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: see the module's docstring
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def rank_share(batch: list, rank: int, world: int) -> list:
    """This rank's groups of a step: every world-th, from its own index."""
    return batch[rank::world]


def gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from sharded ones (a collective: every rank calls it), on the CPU."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in tensors.items()}


def _state(policy, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # What is trained and its optimizer state; the frozen base is the model's own files.
    model, optim = get_state_dict(policy, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model, "optimizer": optim}


def save_sharded(path, policy, optimizer) -> None:
    """torch.distributed.checkpoint: every rank writes its own shards (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(policy, optimizer), checkpoint_id=str(path))


def load_sharded(path, policy, optimizer) -> None:
    """Read a save_sharded checkpoint into this run's shards, whatever the number of ranks that
    wrote it (the checkpoint holds whole-tensor metadata: DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(policy, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))  # frozen: not in it
