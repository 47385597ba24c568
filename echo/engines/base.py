"""The interface every generation engine implements, and what the engines share: the sampler
drives an `Engine` and reads `CompletionOutput`s, whichever engine it is."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from echo.trust.noise import Draw


@dataclass(frozen=True)
class CompletionOutput:
    token_ids: list[int]  # includes the end-of-sequence token when finish_reason == "stop"
    logprobs: list[float]  # behaviour log-prob of each token under the sampling distribution
    text: str
    finish_reason: str  # "stop" or "length"
    # Partial rollouts: (token index, version) where newer weights took over, in order; the
    # tokens before the first were sampled with the version the call started with.
    version_changes: tuple[tuple[int, int], ...] = ()
    # A mixture of experts' routing, where the engine records it: for each token of the prompt and
    # then of the completion, the experts each MoE layer sent it to, (tokens, layers, top_k). The
    # completion's last token was never an input: its row is zeros and means nothing.
    routing: np.ndarray | None = None


def call_seed(run_seed: int, sampler_id: str, term: int, slot: int) -> int:
    """The sampling noise of the generation call that fills `slot` (its first) in the trainer's
    `term`, from the run's seed: a run is reproducible from its config, and no two
    calls draw the same, a restarted sampler's included (slots are numbered once per run: an
    honest sampler must never repeat a completion, which the trainer refuses)."""
    digest = hashlib.sha256(f"{run_seed}/{sampler_id}/{term}/{slot}".encode()).digest()
    return int.from_bytes(digest[:4], "little")  # vLLM's seeds are 32-bit


class NewerWeights(Protocol):
    """Partial rollouts: what an engine that generates in chunks (sampling.chunk_tokens) asks
    between them, from its own thread. The sampler's weights room implements it
    (workers/sampler/weights.py)."""

    def between_chunks(self) -> int | None:
        """Swap newer weights into the engine if the sampler has some: their version (None:
        nothing changed)."""


class Engine(Protocol):
    name: str  # "hf" or "vllm", named in every group it samples
    keyed_noise: bool  # whether it draws with keyed noise (sampling.noise = "keyed", echo/trust/noise.py)
    # (layers, top_k, experts) where it records a mixture of experts' routing (CompletionOutput.routing), else None
    routing: tuple[int, int, int] | None
    device: torch.device
    dtype: torch.dtype  # the precision it samples in
    tokenizer: object  # a transformers tokenizer: multi-turn episodes render observations with it

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt, ending with the assistant's turn opener."""

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        """n sampled completions for each prompt (greedy: the most likely one, for evaluation), of
        at most `max_tokens` (None: sampling.max_new_tokens; an episode's turn takes what is left),
        drawn with `seed` (call_seed: the same call of the same run draws the same; None: fresh),
        or, given `draws` (one per prompt: echo/trust/noise.py's Draw, its group's key), by Gumbel-max
        with keyed noise, which only an engine with `keyed_noise` can.
        An engine that generates in chunks asks `newer_weights` between them; one that does
        not (vLLM here) ignores it, and its completions carry no version changes."""

    def load_weights(self, shards: list[bytearray]) -> None:
        """Swap in a published version (safetensors shards: a LoRA adapter, or every parameter)
        without reloading the model. Raises echo.weights.shards.WeightsMismatch and keeps the current
        weights if they do not fit."""
