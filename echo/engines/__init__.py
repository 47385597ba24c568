"""Generation engines behind one interface: the sampler does not care which it drives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # includes the end-of-sequence token when finish_reason == "stop"
    logprobs: list[float]  # behaviour log-prob of each token under the sampling distribution
    text: str
    finish_reason: str  # "stop" or "length"


class Engine(Protocol):
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt, ending with the assistant's turn opener."""

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False) -> list[list[Generation]]:
        """n sampled completions for each prompt (greedy: the most likely one, for evaluation)."""

    def load_weights(self, shards: list[bytearray]) -> None:
        """Swap in a published version (safetensors shards: a LoRA adapter, or every parameter)
        without reloading the model. Raises echo.policy.WeightsMismatch and keeps the current
        weights if they do not fit."""
