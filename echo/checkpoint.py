"""The trainer's checkpoint: everything needed to resume a run exactly where it stopped.

One file, replaced atomically (write, fsync, rename), so a crash leaves either the old
checkpoint or the new one, never half of one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    version: int = 0  # policy version published after the last step
    trained_ids: list[str] = field(default_factory=list)  # every group trained on, in order
    lost: int = 0  # groups dropped or rejected so far (the admission budget hands them out again)
    record: dict | None = None  # the last step's metrics line, restored if the crash lost it


def save_checkpoint(path: Path, policy, optimizer, state: TrainerState) -> None:
    payload = {
        "adapter": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy).items()},
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "state": vars(state),
    }
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, policy, optimizer) -> TrainerState | None:
    if not path.exists():
        return None
    payload = torch.load(path, weights_only=True)
    set_peft_model_state_dict(policy, payload["adapter"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    return TrainerState(**payload["state"])
