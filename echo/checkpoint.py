"""The trainer's files in the run directory.

checkpoint.pt: everything needed to resume a run exactly where it stopped. One file, replaced
atomically (write, fsync, rename), so a crash leaves either the old checkpoint or the new one,
never half of one.
weights/: the newest published versions' safetensors shards, for `echo-rl eval`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from echo.policy import load_tensors, policy_tensors


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    version: int = 0  # policy version published after the last step
    consumed: dict = field(default_factory=dict)  # stream sequences counted (echo/consumed.py), never twice
    totals: dict[str, int] = field(default_factory=dict)  # messages consumed so far, by what became of them
    trained_content: list[str] = field(default_factory=list)  # their content hashes (replays are refused)
    lost: int = 0  # leases that will never be trained (the admission budget hands them out again)
    record: dict | None = None  # the last step's metrics line, restored if the crash lost it


def save_checkpoint(path: Path, policy, optimizer, state: TrainerState) -> None:
    payload = {
        "policy": policy_tensors(policy),
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
    load_tensors(policy, payload["policy"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    return TrainerState(**payload["state"])


def weights_file(run_dir: Path, version: int, shard: int) -> Path:
    return run_dir / "weights" / f"v{version:06d}-{shard:04d}.safetensors"


def _version_of(path: Path) -> int:
    return int(path.name[1:7])


def latest_weights(run_dir: Path) -> tuple[int, list[Path]]:
    """The newest version in the run directory and its shards, in order."""
    files = sorted((run_dir / "weights").glob("v*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/weights holds no published version")
    version = _version_of(files[-1])
    return version, [f for f in files if _version_of(f) == version]


def prune_weights(run_dir: Path, oldest_kept: int) -> None:
    for path in (run_dir / "weights").glob("v*.safetensors"):
        if _version_of(path) < oldest_kept:
            path.unlink()
