"""A policy's published weights as safetensors shards: made from a model a shard at a time,
read back as views of the fetched buffers, checked against the model and loaded into it."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import safetensors.torch
import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict


class WeightsMismatch(ValueError):
    """Weights that do not fit this model (other base, rank, target modules, or kind)."""


def weights_kind(model) -> str:
    return "lora" if isinstance(model, PeftModel) else "full"


def _published(model) -> dict[str, torch.Tensor]:
    """The tensors a version publishes, as the model holds them: the adapter's, or every
    parameter (named once: tied embeddings are one parameter)."""
    return get_peft_model_state_dict(model) if isinstance(model, PeftModel) else dict(model.named_parameters())


def _whole(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` on the CPU, cast to `dtype` if given. A sharded one (FSDP2's DTensor) is
    gathered whole first: a collective, so every rank walks the same tensors in the same order."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().to(device="cpu", dtype=dtype).contiguous()  # safetensors refuses shared memory


def policy_tensors(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """What a new version publishes, whole, on the CPU, cast to `dtype` if given."""
    return {k: _whole(v, dtype) for k, v in _published(model).items()}


def weights_shards(model, shard_bytes: int, dtype: torch.dtype | None = None) -> Iterator[bytes]:
    """The policy's tensors (cast to `dtype` if given) as safetensors files of about
    `shard_bytes` each (in parameter order; a tensor larger than that gets a file of its own),
    made one at a time: a full model is never held whole a second time."""
    current, size = {}, 0
    for name, tensor in _published(model).items():
        tensor = _whole(tensor, dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            yield safetensors.torch.save(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    yield safetensors.torch.save(current)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def tensors_from_buffer(buffer: bytearray) -> dict[str, torch.Tensor]:
    """Parse a safetensors file held in `buffer` into tensors that are views of it, not
    copies: a fetched shard is loaded into the model with no second copy in memory."""
    try:
        (header_len,) = struct.unpack_from("<Q", buffer, 0)
        header = json.loads(bytes(buffer[8 : 8 + header_len]))
    except (struct.error, ValueError) as e:
        raise WeightsMismatch(f"not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise WeightsMismatch(f"not a safetensors file: the header is a {type(header).__name__}, not a table")
    start, tensors = 8 + header_len, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in [*shape, begin, end]):
                raise ValueError("sizes and offsets are counts")
            numel = torch.Size(shape).numel()
        except (KeyError, TypeError, ValueError):
            raise WeightsMismatch(f"not a safetensors file: bad header entry {name!r}") from None
        if not (0 <= begin <= end <= len(buffer) - start) or end - begin != numel * dtype.itemsize:
            raise WeightsMismatch(f"not a safetensors file: {name} has offsets {begin}..{end} for shape {shape}")
        if numel == 0:  # frombuffer refuses a count of 0
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start + begin).view(shape)
    return tensors


def shards_tensors(shards: list[bytearray]) -> dict[str, torch.Tensor]:
    """Every tensor of a version's shards (views of the buffers)."""
    tensors = {}
    for shard in shards:
        tensors.update(tensors_from_buffer(shard))
    return tensors


def load_weights(model, shards: list[bytearray]) -> None:
    """Load published shards into `model` in place (see load_tensors)."""
    load_tensors(model, shards_tensors(shards))


def load_tensors(model, incoming: dict[str, torch.Tensor]) -> None:
    """Copy policy tensors into `model`, or raise WeightsMismatch and leave it untouched:
    every key and shape is checked before the first tensor is copied."""
    check_tensors(policy_shapes(model), incoming)
    with torch.no_grad():
        if isinstance(model, PeftModel):
            set_peft_model_state_dict(model, incoming)
        else:
            parameters = dict(model.named_parameters())
            for key, tensor in incoming.items():
                parameters[key].copy_(tensor)  # casts to the model's dtype and device


def policy_shapes(model) -> dict[str, torch.Size]:
    """The name and shape of every tensor a version of this policy publishes (policy_tensors)."""
    return {k: v.shape for k, v in _published(model).items()}


def check_tensors(expected: dict[str, torch.Size], incoming: dict[str, torch.Tensor]) -> None:
    """WeightsMismatch unless `incoming` has exactly the expected names and shapes (a dtype may
    differ: loading casts)."""
    if incoming.keys() != expected.keys():
        missing = sorted(expected.keys() - incoming.keys())[:3]
        extra = sorted(incoming.keys() - expected.keys())[:3]
        raise WeightsMismatch(f"weights keys differ: missing {missing}, unexpected {extra}")
    for key, tensor in incoming.items():
        if tensor.shape != expected[key]:
            raise WeightsMismatch(f"{key}: shape {tuple(tensor.shape)}, model has {tuple(expected[key])}")
