"""The interface every generation engine implements, and what the engines share: the sampler
drives an `Engine` and reads `Generation`s, whichever engine it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # includes the end-of-sequence token when finish_reason == "stop"
    logprobs: list[float]  # behaviour log-prob of each token under the sampling distribution
    text: str
    finish_reason: str  # "stop" or "length"


class Engine(Protocol):
    name: str  # "hf" or "vllm", named in every group it samples
    device: torch.device
    dtype: torch.dtype  # the precision it samples in

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt, ending with the assistant's turn opener."""

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False) -> list[list[Generation]]:
        """n sampled completions for each prompt (greedy: the most likely one, for evaluation)."""

    def load_weights(self, shards: list[bytearray]) -> None:
        """Swap in a published version (safetensors shards: a LoRA adapter, or every parameter)
        without reloading the model. Raises echo.policy.WeightsMismatch and keeps the current
        weights if they do not fit."""
