"""A run's published weights kept as files in its run directory (weights/, for `echo-rl eval`
and for the deltas between versions): named by version and shard, found, read, pruned."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch

from echo.weights import delta


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
    return version, weights_at(run_dir, version)


def weights_at(run_dir: Path, version: int) -> list[Path]:
    """A kept version's shards, in order."""
    files = sorted((run_dir / "weights").glob(f"v{version:06d}-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/weights does not hold version {version}")
    return files


def read_shards(files: list[Path]) -> list[bytearray]:
    """A version's shard files as an engine loads them (writable: tensors are views of them)."""
    return [bytearray(f.read_bytes()) for f in files]


def delta_shards(old_files: list[Path], new_files: list[Path], max_bytes: float) -> list[bytes] | None:
    """Each shard of the new version as a packed delta against the old version's shard of the
    same index; None as soon as the changed values alone pass `max_bytes` (weights published in
    fp32 change nearly every element: nothing is packed for them). DeltaError when the two are
    not sharded alike."""
    if len(old_files) != len(new_files):
        raise delta.DeltaError(f"{len(old_files)} shards became {len(new_files)}")
    deltas, values = [], 0
    for old, new in zip(old_files, new_files):
        deltas.append(delta.encode(safetensors.torch.load_file(old), safetensors.torch.load_file(new)))
        values += sum(t.numel() * t.element_size() for key, t in deltas[-1].items() if key.endswith(delta.VALUES))
        if values > max_bytes:
            return None
    return [delta.pack(d) for d in deltas]


def prune_weights(run_dir: Path, oldest_kept: int) -> None:
    for path in (run_dir / "weights").glob("v*.safetensors"):
        if _version_of(path) < oldest_kept:
            path.unlink()
