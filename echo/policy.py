"""The policy: a base model with a peft LoRA adapter, the adapter as safetensors bytes,
and the per-token log-probs of completions (what the trainer differentiates)."""

from __future__ import annotations

from dataclasses import dataclass

import safetensors.torch
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from echo.algorithms.grpo import token_logprobs
from echo.config import LoraConfig


class AdapterMismatch(ValueError):
    """An adapter that does not fit this model (other base, rank or target modules)."""


def add_lora(model: torch.nn.Module, cfg: LoraConfig):
    targets = [name for name in cfg.target_modules if any(n.endswith(name) for n, _ in model.named_modules())]
    if not targets:
        raise ValueError(f"lora.target_modules {cfg.target_modules} match no module of the model")
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)
    return get_peft_model(model, peft_cfg)


def adapter_bytes(model) -> bytes:
    state = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}
    return safetensors.torch.save(state)


def load_adapter(model, data: bytes) -> None:
    """Load adapter bytes into `model` in place, or raise AdapterMismatch and leave it untouched."""
    try:
        incoming = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types for truncated/garbled data
        raise AdapterMismatch(f"not a safetensors file: {e}") from None
    expected = get_peft_model_state_dict(model)
    if incoming.keys() != expected.keys():
        missing = sorted(expected.keys() - incoming.keys())[:3]
        extra = sorted(incoming.keys() - expected.keys())[:3]
        raise AdapterMismatch(f"adapter keys differ: missing {missing}, unexpected {extra}")
    for key, tensor in incoming.items():
        if tensor.shape != expected[key].shape:
            raise AdapterMismatch(f"{key}: shape {tuple(tensor.shape)}, model has {tuple(expected[key].shape)}")
    set_peft_model_state_dict(model, incoming)


@dataclass
class Batch:
    """Prompt + completion sequences, right-padded, with a mask over completion tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L-1], aligned with the shifted targets input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1], zero outside the completion

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def make_batch(sequences: list[tuple[list[int], list[int], list[float]]], pad_id: int) -> Batch:
    """sequences: (prompt ids, completion ids, behaviour log-probs of the completion)."""
    length = max(len(p) + len(c) for p, c, _ in sequences)
    n = len(sequences)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    completion_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    behaviour = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, (prompt, completion, logprobs) in enumerate(sequences):
        total = len(prompt) + len(completion)
        input_ids[i, :total] = torch.tensor(prompt + completion)
        attention_mask[i, :total] = 1
        # Target position t predicts input_ids[t + 1]: completion tokens start at len(prompt) - 1.
        start = len(prompt) - 1
        completion_mask[i, start : start + len(completion)] = True
        behaviour[i, start : start + len(completion)] = torch.tensor(logprobs)
    return Batch(input_ids, attention_mask, completion_mask, behaviour)


def sequence_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Per-token log-probs [B, L-1] of batch.input_ids[:, 1:] under the model."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], temperature)
