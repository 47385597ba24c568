"""The trainer's files in the run directory.

checkpoint.pt: everything needed to resume a run exactly where it stopped. One file, replaced
atomically (write, fsync, rename), so a crash leaves either the old checkpoint or the new one,
never half of one. Its size does not grow with the run.
trained_content.txt: the content hash of every group trained on (replays are refused), one per
line, appended and synced before each checkpoint, which counts the lines that are its own.
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
    trained_content: int = 0  # how many lines of trained_content.txt are this checkpoint's
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


def append_trained_content(run_dir: Path, hashes: list[str]) -> None:
    with open(run_dir / "trained_content.txt", "a") as f:
        f.writelines(h + "\n" for h in hashes)
        f.flush()
        os.fsync(f.fileno())


def load_trained_content(run_dir: Path, count: int) -> set[str]:
    """The checkpoint's `count` hashes; lines a crash left after them are cut off."""
    path = run_dir / "trained_content.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    if len(lines) < count:
        raise RuntimeError(f"{path} holds {len(lines)} content hashes, the checkpoint counts {count}")
    if len(lines) > count:
        path.write_text("".join(h + "\n" for h in lines[:count]))
    return set(lines[:count])
