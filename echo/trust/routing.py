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
import re
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from echo.config import ConfigError
from echo.wire.messages import RolloutGroup, Routing

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


def replayed(model: torch.nn.Module, chosen: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Inside, a forward's router at layer l sends token i to the experts `chosen[l][i]` (OWN:
    its own top-k). One forward: the tensors cover exactly the tokens it routes. Yields the
    routing gaps (routing_gap), one (tokens,) tensor a layer once the forward has run."""
    return _replayed(routers(model), chosen)


@contextlib.contextmanager
def _replayed(found: list[torch.nn.Module], chosen: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    if len(chosen) != len(found):
        raise ValueError(f"routing for {len(chosen)} layers, the model routes in {len(found)}")
    gaps: list[torch.Tensor] = []

    def route(hidden, router, layer):
        logits, scores, indices = gates(router, hidden, layer)
        gaps.append(routing_gap(logits.detach(), indices))
        return logits, scores, indices

    for router, layer in zip(found, chosen):
        router.forward = lambda hidden, router=router, layer=layer: route(hidden, router, layer)
    try:
        yield gaps
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


def router_layers(model: torch.nn.Module) -> list[int]:
    """The decoder layer of each router, in order (`model.layers.<i>.`): a model may route in some
    layers only (Qwen3-MoE's mlp_only_layers), and an engine may report every layer's."""
    return [int(re.search(r"layers\.(\d+)\.", name)[1]) for name, m in model.named_modules() if is_router(m)]


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(layers, top_k, experts) of a mixture of experts' routing (the wire's Routing), or None
    for a dense model."""
    found = routers(model)
    return (len(found), found[0].top_k, found[0].num_experts) if found else None


def replayed_shape(model: torch.nn.Module, name: str, replay: bool) -> tuple[int, int, int] | None:
    """The routing shape a run that replays routing records and checks (None where it does not);
    a dense model asked to is refused at start, naming the field."""
    shape = routing_shape(model) if replay else None
    if replay and shape is None:
        raise ConfigError(f"algorithm.router_replay = 'replay': {name} is a dense model, no router to replay")
    return shape


class RoutingReplay:
    """Routing replay for one packed forward (echo/model/policy.py::packed_states): the experts the
    sampler recorded for each prompt's and each completion's tokens ((tokens, layers, top_k)
    arrays, as Routing carries them; None: the router's own), and afterwards `gaps`: for each
    completion, the largest routing gap of the tokens it was scored from (its prompt's too), on
    the model's device (read once a pass, not a wait a forward): what the proof of sampling
    compares with `trainer.verify_routing_margin`."""

    def __init__(self, prompts: list[np.ndarray | None], completions: list[np.ndarray | None], owners: list[int]):
        self.prompts, self.completions = prompts, completions
        self.owners = torch.tensor(owners)  # completion r continues prompt owners[r]
        self.gaps: torch.Tensor | None = None  # none measured yet

    @classmethod
    def of(cls, pass_groups: list[tuple[RolloutGroup, list[int]]]) -> RoutingReplay:
        """For the completions `rows` of each group, in order (the groups' routing split)."""
        prompts, completions, owners = [], [], []
        for j, (group, rows) in enumerate(pass_groups):
            routing = group.routing
            bounds = len(group.prompt_token_ids) + np.cumsum([0, *(len(c.token_ids) for c in group.completions)])
            prompts.append(None if routing is None else routing.ids[: bounds[0]])
            # A completion's last token is never an input: its row (zeros) is not replayed.
            completions += [None if routing is None else routing.ids[bounds[i] : bounds[i + 1] - 1] for i in rows]
            owners += [j] * len(rows)
        return cls(prompts, completions, owners)

    def again(self) -> RoutingReplay:
        """The same routing, its gaps not yet measured (another forward over the same tokens)."""
        return RoutingReplay(self.prompts, self.completions, self.owners.tolist())

    @contextlib.contextmanager
    def prompts_forward(self, model, width: int) -> Iterator[None]:
        """Inside: the forward of the prompts, left-padded to `width`."""
        with self._forward(model, self.prompts, width, self.owners, left=True):
            yield

    @contextlib.contextmanager
    def completions_forward(self, model, width: int) -> Iterator[None]:
        """Inside: the forward of the completions' inputs (each but its last token), right-padded to `width`."""
        with self._forward(model, self.completions, width, torch.arange(len(self.completions))):
            yield

    @contextlib.contextmanager
    def sequences_forward(self, model, width: int, span: slice) -> Iterator[None]:
        """Inside: a forward of positions `span` of each completion's prompt and inputs, one row each."""
        rows = [None if c is None else np.concatenate([self.prompts[j], c])
                for c, j in zip(self.completions, self.owners.tolist())]
        with self._forward(model, rows, width, torch.arange(len(rows)), span=span):
            yield

    @contextlib.contextmanager
    def _forward(self, model, rows: list[np.ndarray | None], width: int, owners: torch.Tensor, left: bool = False,
                 span: slice = slice(None)) -> Iterator[None]:
        found = routers(model)  # once a forward: a walk over every module
        layers, top_k = len(found), found[0].top_k
        chosen = torch.full((len(rows), width, layers, top_k), OWN, dtype=torch.long)
        for i, row in enumerate(rows):
            if row is not None:
                row = torch.from_numpy(row[:width].astype(np.int64))
                if left:
                    chosen[i, width - len(row) :] = row
                else:
                    chosen[i, : len(row)] = row
        chosen = chosen[:, span]
        with _replayed(found, list(chosen.reshape(-1, layers, top_k).unbind(1))) as gaps:
            yield
        largest = torch.stack(gaps).amax(0).reshape(chosen.shape[:2]).amax(1)
        largest = largest[owners.to(largest.device)]
        self.gaps = largest if self.gaps is None else torch.maximum(self.gaps, largest)


def group_routing(rows: list[np.ndarray], prompt_tokens: int, shape: tuple[int, int, int]) -> Routing:
    """A group's Routing from its completions' (the engine's CompletionOutput.routing, each over its
    prompt and its tokens): the prompt's rows once (the first completion's), then each completion's."""
    layers, top_k, experts = shape
    ids = np.concatenate([rows[0][:prompt_tokens], *(r[prompt_tokens:] for r in rows)])
    return Routing(layers=layers, top_k=top_k, experts=experts, ids=ids)
