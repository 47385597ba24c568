"""The policy: a base model with a peft LoRA adapter, the adapter as safetensors bytes,
and the per-token log-probs of completions (what the trainer differentiates)."""

from __future__ import annotations

import safetensors.torch
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from echo.algorithms.grpo import token_logprobs
from echo.config import ConfigError, LoraConfig


class AdapterMismatch(ValueError):
    """An adapter that does not fit this model (other base, rank or target modules)."""


def add_lora(model: torch.nn.Module, cfg: LoraConfig):
    targets = [name for name in cfg.target_modules if any(n.endswith(name) for n, _ in model.named_modules())]
    if not targets:
        raise ConfigError(f"lora.target_modules {cfg.target_modules} match no module of the model")
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


def group_logprobs(model, prompt_ids: list[int], completions: list[list[int]], temperature: float, pad_id: int):
    """Per-token log-probs [G, C] of a group's completions (right-padded), their mask [G, C],
    and the sampling distribution's entropy at each position [G, C] (no gradient).

    The prompt is shared by the whole group, so it goes through the model once; its key/value
    cache is repeated for each completion. Gradients flow through the cache into the prompt's
    forward, so this equals running every prompt + completion separately, at a fraction of the
    cost when prompts are long (the tests check it against the sampler's own log-probs)."""
    group, prompt_len = len(completions), len(prompt_ids)
    length = max(len(c) for c in completions)
    ids = torch.full((group, length), pad_id, dtype=torch.long)
    mask = torch.zeros((group, length), dtype=torch.bool)
    for i, completion in enumerate(completions):
        ids[i, : len(completion)] = torch.tensor(completion)
        mask[i, : len(completion)] = True
    prompt = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    cache = prompt.past_key_values
    cache.batch_repeat_interleave(group)
    # Completion token t is predicted at position t - 1: the first by the prompt's last position.
    first = prompt.logits[:, -1:].expand(group, 1, -1)
    if length > 1:
        attention = torch.cat([torch.ones((group, prompt_len), dtype=torch.long), mask[:, :-1].long()], dim=1)
        positions = torch.arange(prompt_len, prompt_len + length - 1).expand(group, -1)
        rest = model(
            input_ids=ids[:, :-1], attention_mask=attention, position_ids=positions, past_key_values=cache
        ).logits
        logits = torch.cat([first, rest], dim=1)
    else:
        logits = first
    logprobs, entropy = token_logprobs(logits, ids, temperature, with_entropy=True)
    return logprobs, mask, entropy
