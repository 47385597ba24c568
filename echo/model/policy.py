"""The policy: a base model with a peft LoRA adapter (or, with `lora.enabled = false`, the whole
model trained), and the per-token log-probs of completions (what the trainer differentiates).
Its published weights are echo/weights/shards.py's."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers.modeling_outputs import CausalLMOutputWithPast

from echo.config import ConfigError, LoraConfig
from echo.model.devices import model_device
from echo.train.algorithms.grpo import head_logprobs, token_logprobs
from echo.trust.routing import RoutingReplay

# transformers 5.24 renamed the key/value cache `past_key_values` -> `cache`, as an argument and
# an output (the old name warns); vLLM's CPU build pins transformers < 5.20, which knows only the old.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def kv_cache(out):
    """A forward's or generate's key/value cache, under this transformers' name for it."""
    return getattr(out, CACHE)


# Model families whose causal-LM forward is the output embedding applied to the decoder's last
# hidden state and nothing after it (Gemma soft-caps its logits, Cohere and Granite scale them):
# their log-probs are taken from those hidden states a chunk at a time (head_logprobs), never from
# a pass's whole [tokens x vocabulary] logits.
PLAIN_HEADS = frozenset({"llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _plain_head(model) -> bool:
    return model.config.model_type in PLAIN_HEADS


def _forward(model, **inputs):
    """A forward's cache and what its log-probs are taken from at each position: the final
    hidden states (a plain head: the head's logits only at the last position), else the logits."""
    if _plain_head(model):
        out = model(**{**inputs, "output_hidden_states": True, "logits_to_keep": 1})
        return out.hidden_states[-1], kv_cache(out)
    out = model(**inputs)
    return out.logits, kv_cache(out)


def states_logprobs(model, states, tokens, temperature: float, with_entropy: bool = False, observe=None):
    """Log-probs (and entropy) of `tokens` from what _forward gave at each position; `observe`
    sees the logits made for them (head_logprobs; e.g. echo/trust/noise.py's TokenMargins)."""
    if _plain_head(model):
        return head_logprobs(model.get_output_embeddings(), states, tokens, temperature, with_entropy, observe)
    if observe is not None:
        flat = torch.arange(tokens.numel(), device=tokens.device)
        with torch.no_grad():
            observe(flat // tokens.shape[-1], flat % tokens.shape[-1], tokens.reshape(-1),
                    states.detach().reshape(-1, states.shape[-1]))
    return token_logprobs(states, tokens, temperature, with_entropy)


def make_policy(model: torch.nn.Module, cfg: LoraConfig):
    """The model with a LoRA adapter to train, or the model itself when LoRA is off."""
    if not cfg.enabled:
        return model
    targets = [name for name in cfg.target_modules if any(n.endswith(name) for n, _ in model.named_modules())]
    if not targets:
        raise ConfigError(f"lora.target_modules {cfg.target_modules} match no module of the model")
    weights = [name for name in cfg.target_parameters if any(n.endswith(name) for n, _ in model.named_parameters())]
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              target_parameters=weights or None)
    return get_peft_model(model, peft_cfg)


def group_logprobs(model, prompt_ids, completions: list, temperature: float, pad_id: int,
                   min_length: int = 1):
    """Per-token log-probs [G, C] of one group's completions, their mask and entropy: see
    packed_logprobs (one prompt, which every completion continues)."""
    return packed_logprobs(model, [prompt_ids], completions, [0] * len(completions), temperature, pad_id, min_length)


def packed_logprobs(model, prompts: list, completions: list, owners: list[int], temperature: float, pad_id: int,
                    min_length: int = 1, replay: RoutingReplay | None = None):
    """Per-token log-probs [R, C] of completions (arrays or lists of token ids; right-padded to at
    least `min_length`), their mask [R, C], and the sampling distribution's entropy at each
    position [R, C] (no gradient). Completion r continues prompt `owners[r]`.

    Two model calls, however many prompts: the prompts (left-padded to the longest) go through
    the model once, and each completion attends to its own prompt's key/value cache. Gradients
    flow through the cache into the prompts' forward, so this equals running every prompt +
    completion separately (the tests check it, and against the sampler's own log-probs), at a
    fraction of the cost: a group's prompt runs once, not once per completion, and many short
    groups share the two calls instead of making two each (on a GPU a call of a small model
    costs its kernel launches, not its arithmetic). With `replay`, a mixture of experts routes each
    token as its sampler recorded (echo/trust/routing.py)."""
    states, ids, mask = packed_states(model, prompts, completions, owners, pad_id, min_length, replay)
    logprobs, entropy = states_logprobs(model, states, ids, temperature, with_entropy=True)
    return logprobs, mask, entropy


def packed_states(model, prompts: list, completions: list, owners: list[int], pad_id: int, min_length: int = 1,
                  replay: RoutingReplay | None = None):
    """What packed_logprobs reads the log-probs from at each completion position (see _forward),
    the completions' ids [R, C] and their mask [R, C]: the two model calls (each routed as
    `replay` says, where given)."""
    rows, length = len(completions), max(min_length, *(len(c) for c in completions))
    device = model_device(model)
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    prompt_ids = torch.full((len(prompts), int(prompt_lengths.max())), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(prompt_ids.shape, dtype=torch.long)
    for j, prompt in enumerate(prompts):
        prompt_ids[j, prompt_ids.shape[1] - len(prompt):] = torch.from_numpy(np.asarray(prompt, dtype=np.int64))
        prompt_mask[j, prompt_ids.shape[1] - len(prompt):] = 1
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.bool)
    for i, completion in enumerate(completions):
        ids[i, : len(completion)] = torch.from_numpy(np.asarray(completion, dtype=np.int64))
        mask[i, : len(completion)] = True
    owner = torch.tensor(owners, device=device)
    ids, mask, prompt_ids, prompt_mask = ids.to(device), mask.to(device), prompt_ids.to(device), prompt_mask.to(device)
    # Left padding: a prompt's positions count from its first real token.
    with replay.prompts_forward(model, prompt_ids.shape[1]) if replay else contextlib.nullcontext():
        prompt, cache = _forward(model, input_ids=prompt_ids, attention_mask=prompt_mask,
                                 position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    cache.batch_select_indices(owner)  # each completion's own prompt's keys and values
    # Completion token t is predicted at position t - 1: the first by its prompt's last position.
    states = prompt[owner, -1:]
    if length > 1:
        attention = torch.cat([prompt_mask[owner], mask[:, :-1].long()], dim=1)
        positions = prompt_lengths.to(device)[owner, None] + torch.arange(length - 1, device=device)
        with replay.completions_forward(model, length - 1) if replay else contextlib.nullcontext():
            rest, _ = _forward(model, input_ids=ids[:, :-1], attention_mask=attention, position_ids=positions,
                               **{CACHE: cache})
        states = torch.cat([states, rest], dim=1)
    return states, ids, mask


def spanning_logprobs(model, prompt_ids, completions: list, starts: list[int], use_version, temperature: float,
                      pad_id: int, observe=None, replay: RoutingReplay | None = None) -> torch.Tensor:
    """Per-token log-probs [G, C] of one group's completions sampled by several versions in turn
    (partial rollouts): version k predicted the tokens from `starts[k]` on (starts[0] = 0), and
    `use_version(k)` puts its weights in the model. As in generation, a swap keeps the cache:
    version k also reads in the token before its first, and attends to the keys and values the
    earlier versions left; its tokens' log-probs are read through its own head (in full-weight
    mode the head is trained too). `observe` sees the logits (states_logprobs); `replay` routes
    each token as its sampler recorded (each under the version that sampled it)."""
    rows, length = len(completions), max(len(c) for c in completions)
    device = model_device(model)
    prompt = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).repeat(rows, 1)
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    for i, completion in enumerate(completions):
        ids[i, : len(completion)] = torch.from_numpy(np.asarray(completion, dtype=np.int64))
    inputs = torch.cat([prompt, ids[:, :-1]], dim=1).to(device)  # input j predicts completion token j + 1 - P
    cuts = [0, *(prompt.shape[1] + s - 1 for s in starts[1:]), inputs.shape[1]]
    ids, cache, logprobs = ids.to(device), None, []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        use_version(k)
        with replay.sequences_forward(model, inputs.shape[1], slice(a, b)) if replay else contextlib.nullcontext():
            out, cache = _forward(model, input_ids=inputs[:, a:b], use_cache=True, **{CACHE: cache})
        states = out[:, max(0, prompt.shape[1] - 1 - a):]  # completion positions starts[k] on
        begin = starts[k]

        def shown(rows, positions, tokens, logits, begin=begin):
            observe(rows, positions + begin, tokens, logits)

        logprobs.append(states_logprobs(model, states, ids[:, begin : begin + states.shape[1]], temperature,
                                        observe=None if observe is None else shown))
    return torch.cat(logprobs, dim=1)
