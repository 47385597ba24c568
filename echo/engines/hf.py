"""The transformers engine: peft LoRA on top of the base model (or the plain model in full-weight
mode), generation with `generate`."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from echo.config import LoraConfig, SamplingConfig
from echo.devices import resolve_device, resolve_dtype
from echo.engines.base import Generation
from echo.models import encode_chat, load_model
from echo.policy import load_weights, make_policy


class HFEngine:
    name = "hf"

    def __init__(self, model_name: str, lora: LoraConfig, sampling: SamplingConfig, device: str = "auto",
                 dtype: str = "auto"):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        base, self.tokenizer = load_model(model_name, self.device, self.dtype)
        # peft keeps the adapter in fp32 over a 16-bit base; published weights are cast on load.
        self.model = make_policy(base, lora).eval()
        self.temperature = sampling.temperature
        # Plain sampling at `temperature`: no top-k/top-p, so the behaviour log-probs the
        # trainer receives are those of the distribution the tokens were really drawn from.
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def load_weights(self, shards: list[bytearray]) -> None:
        load_weights(self.model, shards)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False) -> list[list[Generation]]:
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.device)
        config = copy.deepcopy(self.generation_config)
        config.num_return_sequences = n
        if greedy:  # evaluation: the log-probs are then those of the tempered distribution, unused
            config.do_sample = False
            config.temperature, config.top_k, config.top_p = None, None, None
        out = self.model.generate(**batch, generation_config=config)
        new_tokens = out.sequences[:, batch["input_ids"].shape[1] :]
        # out.logits holds the raw scores of each step; the sampled token's log-prob under
        # softmax(logits / T) is the behaviour log-prob.
        steps = torch.stack(out.logits, dim=1).float() / self.temperature
        logprobs = torch.log_softmax(steps, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        new_tokens, logprobs = new_tokens.cpu(), logprobs.cpu()
        eos = self.tokenizer.eos_token_id
        generations = []
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            finish = "length"
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
                finish = "stop"
            generations.append(
                Generation(
                    token_ids=ids,
                    logprobs=logprobs[row, : len(ids)].tolist(),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason=finish,
                )
            )
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]
