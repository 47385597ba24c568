"""What runs inside vLLM's own processes: methods mixed into its workers
(`LLM(worker_extension_cls=...)`, called with `llm.collective_rpc(name, args)`: full-weight
updates in place, without a restart), and the logits processor that draws keyed noise
(`LLM(logits_processors=[KeyedNoise])`). Imported by vLLM only."""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from echo.trust.noise import keyed_draw

NOISE_ARG = "echo_noise"  # SamplingParams.extra_args key: [key low, key high, completion, first position, T]


class WeightsReloader:
    def echo_reload_weights(self, paths: list[str]) -> None:
        """Load every tensor of these safetensors files (Hugging Face names) into the running
        model. `model.load_weights` works only once on some platforms (the CPU backend repacks
        linear weights after loading and drops their loaders); `reload_weights` re-arms them."""
        from safetensors import safe_open

        def tensors():
            for path in paths:
                with safe_open(path, "pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        # With tied embeddings the lm_head shares the embedding's weight, but a backend that
        # packed its own copy of it at load time (the CPU one) keeps the old one: pack it again.
        model = self.model_runner.model
        if getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class KeyedNoise(LogitsProcessor):
    """Gumbel-max with keyed noise (echo/trust/noise.py) for the requests whose extra_args carry
    NOISE_ARG, which are greedy (temperature 0): each row becomes -inf but at the noisy argmax of
    logits / T, whose value is that token's log-softmax(logits / T). Greedy sampling takes that
    token, and with logprobs_mode "processed_logits" vLLM reports that value: the behaviour
    log-prob (the raw log-probs are untempered; processed ones would be of these rows). A
    request's token at step t is at position first + t: its output ids so far, a list vLLM keeps
    current. Other requests (an evaluation's greedy ones) pass as they are."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[list, list[int]]] = {}  # batch index -> (NOISE_ARG, its output ids)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the greedy token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _keyed)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(self.rows)
        device = logits.device
        low, high, completion, first = torch.tensor([self.rows[i][0][:4] for i in index], device=device).unbind(1)
        drawn = torch.tensor([len(self.rows[i][1]) for i in index], device=device)
        temperature = torch.tensor([self.rows[i][0][4] for i in index], dtype=torch.float32, device=device)
        rows = torch.tensor(index, device=device)
        _, token, logprob = keyed_draw(logits[rows].float() / temperature[:, None], low, high, completion,
                                       first + drawn)
        chosen = torch.full((len(index), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=device)
        logits[rows] = chosen.scatter_(1, token[:, None], logprob[:, None].to(logits.dtype))
        return logits


def _keyed(params, _prompt_ids, output_ids: list[int]):
    noise = (params.extra_args or {}).get(NOISE_ARG)
    return None if noise is None else (noise, output_ids)
