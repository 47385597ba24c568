"""Mixture-of-experts routing, recorded where tokens are sampled and replayed where they are
scored (routing replay, "R3", as verl, ROLL and NeMo-RL ship it).

A router's top-k choice of experts is discontinuous: where two experts' logits nearly tie, a
16-bit engine and an fp32 trainer pick different ones, and the token's log-prob then differs by
far more than rounding would explain. With replay, the trainer's forward sends each token to the
experts the sampler chose; the gate weights are recomputed from the trainer's own router logits
over those experts, so the router still learns. A recorded choice is a claim, so `routing_gap`
says how far it lies from the trainer's own top-k: numeric noise, or a forgery.

Routers are found by what they are (transformers 5's top-k routers, as Qwen2-MoE and Qwen3-MoE
have them): a module with `weight` (experts x hidden), `top_k`, `num_experts` and
`norm_topk_prob`, whose forward takes the hidden states and gives (logits, scores, indices), the
scores a softmax over all experts taken at the top k (renormalised over them if norm_topk_prob).
Pure: no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

OWN = -1  # in a replayed choice: this token's experts are the trainer's own top-k (no record for it)


def is_router(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("weight", "top_k", "num_experts", "norm_topk_prob")) and \
        isinstance(module.weight, torch.nn.Parameter) and module.weight.dim() == 2


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if is_router(m)]


def gates(router: torch.nn.Module, hidden: torch.Tensor, chosen: torch.Tensor | None):
    """A router's (logits, scores, indices) for the tokens in `hidden`: its own top-k, or where
    `chosen` (tokens x k) is given and not OWN, those experts, weighted by its own softmax."""
    hidden = hidden.reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    own = torch.topk(probs, router.top_k, dim=-1).indices
    indices = own if chosen is None else torch.where(chosen >= 0, chosen.to(own.device), own)
    scores = probs.gather(-1, indices)
    if router.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), indices


@contextlib.contextmanager
def recorded(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Inside, each router's choices are kept: `calls[layer]` gets one (tokens, k) tensor of
    expert ids a forward, tokens in the order the router saw them (the batch flattened)."""
    found = routers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in found]
    hooks = [r.register_forward_hook(lambda _m, _i, out, kept=kept: kept.append(out[2].detach().cpu()))
             for r, kept in zip(found, calls)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def replayed(model: torch.nn.Module, chosen: list[torch.Tensor]) -> Iterator[None]:
    """Inside, a forward's router at layer l sends token i to the experts `chosen[l][i]` (OWN:
    its own top-k). One forward: the tensors cover exactly the tokens it routes."""
    found = routers(model)
    if len(chosen) != len(found):
        raise ValueError(f"routing for {len(chosen)} layers, the model routes in {len(found)}")
    for router, layer in zip(found, chosen):
        router.forward = lambda hidden, router=router, layer=layer: gates(router, hidden, layer)
    try:
        yield
    finally:
        for router in found:
            del router.forward  # the class's own again


def routing_gap(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """For each token, how far below the router's own k-th largest logit the lowest chosen
    expert's logit lies (0 when the choice is its own top-k): numeric noise stays within a
    small margin; a choice made up stands far off."""
    k = chosen.shape[-1]
    kth = torch.topk(logits.float(), k, dim=-1).values[..., -1]
    return (kth - logits.float().gather(-1, chosen.long()).min(dim=-1).values).clamp(min=0)
