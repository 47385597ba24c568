"""Where a process computes and in what precision: `model.device` and `model.dtype` resolved
against the hardware this process sees (each process its own: the trainer, every sampler, eval).

auto device: CUDA, then Apple's MPS, then the CPU. auto dtype: bf16 on a CUDA device that has
it (fp16 on older ones), fp16 on MPS, fp32 on the CPU (16-bit matmuls on a CPU are slower).
"""

from __future__ import annotations

import contextlib

import torch

from echo.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"model.device = {name!r}: this machine's torch {torch.__version__} sees "
                              f"{count} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"model.device = {name!r}: MPS is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def sampler_dtype(name: str, device: torch.device, allowed: list[str]) -> torch.dtype:
    """A sampler's precision: `model.dtype` resolved on this machine, within the run's
    `sampling.dtypes`: auto falls back to float32 where this machine's choice is not allowed; an
    explicit one not allowed fails at start, before a group the trainer would strike."""
    dtype = resolve_dtype(name, device)
    if dtype_name(dtype) in allowed:
        return dtype
    if name == "auto" and "float32" in allowed:
        return torch.float32
    raise ConfigError(f"model.dtype = {name!r} ({dtype_name(dtype)} on this machine): the run's sampling.dtypes "
                      f"{allowed} do not allow it; set model.dtype to one of them, or add it to sampling.dtypes")


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def autocast(device: torch.device, dtype: torch.dtype):
    """The trainer's forward in `dtype` over fp32 trainable parameters (mixed precision); a
    no-op in fp32. Entered in the thread that runs the forward: autocast is thread-local."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
