"""The trainer's files in the run directory.

checkpoint.pt: everything needed to resume a run exactly where it stopped: the trainer state,
RNG, and the name of the folder in checkpoint/ that holds what is trained and its optimizer
state (torch.distributed.checkpoint: each rank writes its own shards; any number of ranks, or
one process, reads them back). One small file, replaced atomically (write, fsync, rename) after
its folder is complete, so a crash leaves either the old checkpoint or the new one, never half
of one. Its size does not grow with the run.
trained_content.txt: the content hash of every group trained on (replays are refused), one per
line, appended and synced before each checkpoint, which counts the lines that are its own.
trained_completions.bin: the key of every completion trained on (resent ones are refused),
8 bytes each, kept the same way.
(weights/, the newest published versions' shards, is echo/weights/files.py's.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    version: int = 0  # policy version published after the last step
    consumed: dict = field(default_factory=dict)  # stream sequences counted (echo/fleet/consumed.py), never twice
    totals: dict[str, int] = field(default_factory=dict)  # messages consumed so far, by what became of them
    trained_content: int = 0  # how many lines of trained_content.txt are this checkpoint's
    trained_completions: int = 0  # how many keys of trained_completions.bin are
    lost: int = 0  # slots that will never be trained (the grant budget hands them out again)
    record: dict | None = None  # the last step's metrics line, restored if the crash lost it
    base_model: str = ""  # the base's digest (echo/model/loading.py::base_model_digest): a resume on another is refused


def save_checkpoint(path: Path, model, optimizer, state: TrainerState, rng_states: list[torch.Tensor] | None = None,
                    commit: bool = True) -> None:
    """On several ranks every rank calls it (each writes its shards) and one commits, with
    every rank's RNG state in `rng_states`."""
    folder = path.with_suffix("") / f"step-{state.step:06d}"
    with _one_process_is_fine():
        dcp.save(_trained_state(model, optimizer), storage_writer=dcp.FileSystemWriter(folder, overwrite=True),
                 no_dist=not dist.is_initialized())
    if not commit:
        return
    payload = {"model": folder.name, "torch_rng": rng_states or [torch.get_rng_state()], "state": vars(state)}
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in folder.parent.iterdir():  # earlier steps', and any a crash left half written
        if old != folder:
            shutil.rmtree(old)


def load_checkpoint(path: Path, model, optimizer, rank: int = 0) -> TrainerState | None:
    """Resume what `save_checkpoint` wrote into this process's (or rank's) policy and
    optimizer, whatever the number of ranks that wrote it."""
    if not path.exists():
        return None
    payload = torch.load(path, weights_only=True)
    if "model" not in payload:
        raise RuntimeError(f"{path} was written by an older echo-rl (one file, no checkpoint/ folder): "
                           "resume it with that version, or start the run afresh in another directory")
    trained = _trained_state(model, optimizer)
    with _one_process_is_fine():
        dcp.load(trained, checkpoint_id=path.with_suffix("") / payload["model"], no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=trained["model"], optim_state_dict=trained["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))  # frozen: not in it
    rngs = payload["torch_rng"]
    torch.set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])  # fewer ranks before: rank 0's
    return TrainerState(**payload["state"])


@contextlib.contextmanager
def _one_process_is_fine():
    with warnings.catch_warnings():  # DCP warns whenever it runs without a process group
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _trained_state(model, optimizer) -> dict:
    """What is trained and its optimizer state, as the ranks hold them; the frozen base is the
    model's own files."""
    model_state, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_state, "optimizer": optim}


def remember_trained(run_dir: Path, state: TrainerState, contents: list[str], keys: list[int]) -> None:
    """Before the step's checkpoint: what it trained (its groups' content hashes and completion
    keys), so no later trainer of the run trains it again (a replayed group, a completion resent)."""
    append_trained_content(run_dir, contents)
    append_trained_completions(run_dir, keys)
    state.trained_content += len(contents)
    state.trained_completions += len(keys)


def append_trained_content(run_dir: Path, hashes: list[str]) -> None:
    _append_synced(run_dir / "trained_content.txt", "".join(h + "\n" for h in hashes).encode())


def load_trained_content(run_dir: Path, count: int) -> set[str]:
    """The checkpoint's `count` hashes; lines a crash left after them are cut off."""
    path = run_dir / "trained_content.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    _keep_first(path, count, len(lines), "content hashes", "".join(h + "\n" for h in lines[:count]).encode())
    return set(lines[:count])


def append_trained_completions(run_dir: Path, keys: list[int]) -> None:
    _append_synced(run_dir / "trained_completions.bin", np.asarray(keys, dtype="<u8").tobytes())


def load_trained_completions(run_dir: Path, count: int) -> set[int]:
    """The checkpoint's `count` completion keys (echo/trust/scorer.py completion_keys); what a crash
    left after them is cut off."""
    path = run_dir / "trained_completions.bin"
    data = path.read_bytes() if path.exists() else b""
    _keep_first(path, count, len(data) // 8, "completion keys", data[: 8 * count])
    return set(np.frombuffer(data, dtype="<u8", count=count).tolist())


def _append_synced(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _keep_first(path: Path, count: int, held: int, what: str, kept: bytes) -> None:
    # An append-only log the checkpoint counts: appended and synced before each checkpoint, so it
    # holds at least the checkpoint's `count` records (`kept`), and a crash may have left more.
    if held < count:
        raise RuntimeError(f"{path} holds {held} {what}, the checkpoint counts {count}")
    if path.exists() and path.stat().st_size != len(kept):
        path.write_bytes(kept)
