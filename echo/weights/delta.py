"""Sparse deltas between two versions of full weights, bit for bit: pure, no I/O (issue 47).

Between consecutive RL steps most elements of weights published in bf16 keep their bits (an
Adam step smaller than half a bf16 unit in the last place leaves the rounding where it was). A
delta names, per tensor, which elements changed (a bitmask, one bit an element) and how: the old
bits XOR the new, as integers of the element's width (a step of an ulp or two flips only low
bits, so these compress to a few bits each, where the new values would not); anything else is
the old version's. Comparison is of the bits, not the values: -0.0 against 0.0, or one NaN
against another, is a change, so that applying a delta reproduces the new version exactly and
the digest of the whole (echo/weights/digest.py) proves it. A delta is safetensors tensors like a version's shard (`<name>.changed`, uint8,
`<name>.values`), so it travels, shards and is digest-checked as weights do.

On the wire (`pack`) a delta is that safetensors file compressed with zlib: a sparse mask is
mostly zero bytes. An untrusted delta is checked before it touches anything (`unpack` and
`apply` raise DeltaError): it inflates to no more than its caller allows, every tensor it names
exists, its mask covers exactly the tensor's elements with no bit past the end, and it carries
exactly as many values, integers of the tensor's element width, as bits set.

`route` is the sampler's choice of what to fetch: the deltas after the version it holds, when it
holds one of the announced chain, else the anchor and every delta after it.
"""

from __future__ import annotations

import zlib

import numpy as np
import safetensors.torch
import torch

from echo.weights.digest import BITS, bits
from echo.wire.messages import WeightsAnnouncement, WeightsLink

CHANGED, VALUES = ".changed", ".values"


class DeltaError(ValueError):
    """A delta that does not apply to the weights held: the caller fetches a whole version."""


def encode(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta that turns `old` into `new` (the same names, shapes and dtypes: else DeltaError,
    and the version goes whole)."""
    if old.keys() != new.keys():
        raise DeltaError(f"tensors differ: {sorted(old.keys() ^ new.keys())[:3]}")
    delta = {}
    for name, tensor in new.items():
        before = old[name]
        if before.shape != tensor.shape or before.dtype != tensor.dtype:
            raise DeltaError(f"{name}: {tuple(before.shape)} {before.dtype} became "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        old_bits, new_bits = bits(before), bits(tensor)
        changed = (old_bits != new_bits).numpy()
        if not changed.any():
            continue
        delta[name + CHANGED] = torch.from_numpy(np.packbits(changed))
        moved = torch.from_numpy(changed)
        delta[name + VALUES] = old_bits[moved] ^ new_bits[moved]
    return delta


def apply(old: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`old` with `delta`'s changes, as new tensors (`old` is left as it was: a delta that fails
    half way leaves the weights held whole). DeltaError for a delta that is not `old`'s."""
    names = {key.removesuffix(CHANGED) for key in delta if key.endswith(CHANGED)}
    strays = {key for key in delta if key.removesuffix(CHANGED).removesuffix(VALUES) not in names}
    if unknown := strays | (names - old.keys()):
        raise DeltaError(f"entries for no tensor held: {sorted(unknown)[:3]}")
    new = dict(old)
    for name in names:
        tensor, mask, values = old[name], delta[name + CHANGED], delta.get(name + VALUES)
        n = tensor.numel()
        if mask.dtype != torch.uint8 or mask.dim() != 1 or mask.numel() != (n + 7) // 8:
            raise DeltaError(f"{name}: a mask of {mask.numel()} {mask.dtype} for {n} elements")
        changed = np.unpackbits(mask.numpy(), count=None)
        if changed[n:].any():
            raise DeltaError(f"{name}: changes past its {n} elements")
        changed = torch.from_numpy(changed[:n].astype(bool))
        count = int(changed.sum())
        width = BITS[tensor.element_size()]
        if values is None or values.dtype != width or values.dim() != 1 or values.numel() != count:
            got = "none" if values is None else f"{values.numel()} {values.dtype}"
            raise DeltaError(f"{name}: {count} changes and {got} values (of {width}, for {tensor.dtype})")
        flat = bits(tensor).clone()
        flat[changed] ^= values
        new[name] = flat.view(tensor.dtype).view(tensor.shape)
    return new


def pack(delta: dict[str, torch.Tensor]) -> bytes:
    """A delta as one object's bytes: its safetensors file, zlib-compressed."""
    return zlib.compress(safetensors.torch.save(delta), level=1)


def unpack(data: bytes, max_bytes: int) -> dict[str, torch.Tensor]:
    """A packed delta's tensors; DeltaError if it is not one or would inflate past `max_bytes`
    (a delta is never much larger than the weights it changes)."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, max_bytes + 1)
        if len(raw) > max_bytes or inflater.unconsumed_tail or not inflater.eof:
            raise DeltaError(f"not a delta of at most {max_bytes} bytes")
        return safetensors.torch.load(raw)
    except (zlib.error, safetensors.SafetensorError) as e:
        raise DeltaError(f"not a packed delta: {e}") from None


def route(announcement: WeightsAnnouncement, held: WeightsAnnouncement | None) -> list[WeightsLink]:
    """The announced version's links to fetch and apply in turn: after the one held (the same
    trainer's version, with the same digest) when it is in the chain, else from the anchor."""
    links = announcement.links
    if held is not None and held.term == announcement.term and held.digest:
        for i, link in enumerate(links):
            if link.version == held.version and link.digest == held.digest:
                return links[i + 1:]
    return links


def changed_fraction(delta: dict[str, torch.Tensor], total_elements: int) -> float:
    """The share of all `total_elements` a delta changes."""
    return sum(t.numel() for key, t in delta.items() if key.endswith(VALUES)) / max(total_elements, 1)


def send_whole(version: int, last_whole: int | None, delta_bytes: int, whole_bytes: int, every: int,
               max_share: float) -> bool:
    """Whether `version` goes out whole (an anchor) rather than as a delta: the first, every
    `every` versions after the last anchor (so a late joiner's chain is short), or when the
    delta would be more than `max_share` of the whole."""
    return last_whole is None or version - last_whole >= every or delta_bytes > max_share * whole_bytes
