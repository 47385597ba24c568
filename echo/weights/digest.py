"""The one digest of weights, wherever they are: SHA-256 over every tensor in name order, each
as its name, torch dtype and shape, then its bytes (row-major, little-endian: safetensors' own
layout, and a contiguous tensor's), written `sha256:<hex>`. Two holders of the same digest hold
the same weights, however they got them: the base model a sampler loaded and the trainer's
(`echo/model/loading.py::base_model_digest`), a version rebuilt from deltas and the one the
trainer wrote (`echo/weights/delta.py`). Pure: files are read, piece by piece, only where named.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits, by its item size
READ = 1 << 24  # bytes a read: the digest of files holds one such piece, not the model (61 GB for Qwen3-30B-A3B)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements as integers of their width: its bits, compared and hashed as they are."""
    return tensor.detach().contiguous().view(-1).view(BITS[tensor.element_size()])


def _tensor(h, name: str, dtype: torch.dtype, shape: Iterable[int], pieces: Iterable[bytes]) -> None:
    h.update(f"{name}|{dtype}|{tuple(shape)}|".encode())
    for piece in pieces:
        h.update(piece)


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest of weights held in memory."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        _tensor(h, name, tensor.dtype, tensor.shape, [bits(tensor).numpy().tobytes()])
    return "sha256:" + h.hexdigest()


def files_digest(files: list[Path]) -> str:
    """The digest of the weights in safetensors `files`, read piece by piece (ValueError for a
    file that is not one, or a tensor torch cannot load)."""
    from safetensors.torch import _TYPES as DTYPES

    where = {}
    for f in files:
        with open(f, "rb") as opened:
            size = int.from_bytes(opened.read(8), "little")
            try:
                header = json.loads(opened.read(size))
            except ValueError as e:
                raise ValueError(f"{f}: not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        where |= {name: (f, 8 + size, h) for name, h in header.items()}
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(open(f, "rb")) for f in files}
        for name in sorted(where):
            f, data, header = where[name]
            if header["dtype"] not in DTYPES:
                raise ValueError(f"{f}: tensor {name} has dtype {header['dtype']}, which torch does not load")
            start, end = header["data_offsets"]
            opened[f].seek(data + start)
            _tensor(h, name, DTYPES[header["dtype"]], header["shape"],
                    (opened[f].read(min(READ, end - at)) for at in range(start, end, READ)))
    return "sha256:" + h.hexdigest()
