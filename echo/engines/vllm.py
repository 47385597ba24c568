"""The vLLM engine: the base model loaded once, each policy version a new LoRA adapter (or, in
full-weight mode, new weights loaded in place), whole groups per request (`n = group_size`).

Behaviour log-probs are vLLM's *processed* log-probs: those of the distribution it sampled from,
after temperature (its default, raw log-probs, are the model's untempered ones). With keyed noise
(sampling.noise = "keyed") its sampler draws through echo/engines/vllm_worker.py's KeyedNoise,
which reports each token's log-softmax(logits / T) as its processed logit."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from transformers import AutoTokenizer

from echo.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig
from echo.engines.base import CompletionOutput, NewerWeights
from echo.model.devices import dtype_name, resolve_device, sampler_dtype
from echo.model.loading import encode_chat, model_folder, model_on_meta
from echo.model.policy import make_policy
from echo.trust.noise import Draw, key_halves
from echo.trust.routing import replayed_shape, router_layers
from echo.weights.shards import check_tensors, policy_shapes, shards_tensors

CPU_KV_CACHE_BYTES = 2**30
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(r: int) -> int:
    for size in LORA_RANKS:
        if size >= r:
            return size
    raise ConfigError(f"lora.r = {r}: vLLM serves adapters of rank up to {LORA_RANKS[-1]}")


class VLLMEngine:
    name = "vllm"
    keyed_noise = True  # through a logits processor (vllm_worker.KeyedNoise)

    def __init__(self, model: ModelConfig, lora: LoraConfig, sampling: SamplingConfig, record_routing: bool = False):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the sampler logs what matters itself
        from vllm import LLM

        self.device = resolve_device(model.device)
        if self.device.type not in ("cuda", "cpu"):
            raise ConfigError(f"model.device = {model.device!r}: vLLM runs on CUDA or the CPU; use sampler.engine = 'hf'")
        self.dtype = sampler_dtype(model.dtype, self.device, sampling.dtypes)
        folder = model_folder(model.name)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        # What a published version must look like, from the model's shapes alone (no weights).
        meta_model = model_on_meta(model.name)
        # A mixture of experts' routing: vLLM returns every decoder layer's; ours are the MoE layers'
        self.routing = replayed_shape(meta_model, model.name, record_routing)
        self.moe_layers = router_layers(meta_model)
        meta_policy = make_policy(meta_model, lora)
        self.expected = policy_shapes(meta_policy)
        self.lora = lora.enabled
        # Adapters and full-weight shards go through files: RAM-backed where there is /dev/shm.
        self.scratch = Path(tempfile.mkdtemp(prefix="echo-vllm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        weakref.finalize(self, shutil.rmtree, self.scratch, True)
        if self.lora:
            meta_policy.peft_config["default"].save_pretrained(self.scratch / "adapter-config")
        self.keyed = sampling.noise == "keyed"
        # keyed: KeyedNoise leaves a drawn token's log-prob as its processed logit (it decides greedily)
        keyed = {"logprobs_mode": "processed_logits", "logits_processors": ["echo.engines.vllm_worker:KeyedNoise"]}
        cpu = {}
        if self.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # else its worker gets one core of two
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # else vLLM takes a share of the machine's memory
                cpu["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        try:
            self.llm = LLM(
                model=str(folder),
                dtype=dtype_name(self.dtype),
                seed=int.from_bytes(os.urandom(4), "little"),  # samplers on the same prompt must not draw the same
                enable_lora=self.lora,
                max_lora_rank=vllm_lora_rank(lora.r) if self.lora else None,
                max_loras=1,
                **(keyed if self.keyed else {"logprobs_mode": "processed_logprobs"}),
                enforce_eager=self.device.type == "cpu",  # no compile step on the CPU: start in seconds
                worker_extension_cls="echo.engines.vllm_worker.WeightsReloader",
                # vLLM 0.15 on (#28284). Its CPU build (0.32) refuses it: its V2 model runner
                # needs Triton, which has no CPU backend there.
                **({"enable_return_routed_experts": True} if self.routing else {}),
                **cpu,
            )
        except ValueError as e:  # vLLM's config check (pydantic's ValidationError)
            if not self.routing:
                raise
            reason = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
            raise ConfigError("algorithm.router_replay = 'replay' with sampler.engine = 'vllm': this vLLM cannot "
                              f"return routed experts ({reason}); hf and hf-paged record them") from None
        self.temperature, self.max_new_tokens = sampling.temperature, sampling.max_new_tokens
        self.adapter = None  # the current version's LoRARequest; None: the base model
        self.versions_loaded = 0  # adapter ids and names are never reused: vLLM caches by them

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def load_weights(self, shards: list[bytearray]) -> None:
        tensors = shards_tensors(shards)
        check_tensors(self.expected, tensors)  # WeightsMismatch before anything changes
        if self.lora:
            self._new_adapter(tensors)
        else:
            self._reload(shards)

    def _new_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.lora.request import LoRARequest

        self.versions_loaded += 1
        n = self.versions_loaded
        folder = self.scratch / f"adapter-{n}"
        shutil.copytree(self.scratch / "adapter-config", folder)
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
        adapter = LoRARequest(f"policy-{n}", n, str(folder))
        self.llm.llm_engine.add_lora(adapter)
        previous, self.adapter = self.adapter, adapter
        if previous is not None:  # memory stays flat: one adapter at a time
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _reload(self, shards: list[bytearray]) -> None:
        paths = []
        for i, shard in enumerate(shards):
            paths.append(str(self.scratch / f"full-{i}.safetensors"))
            Path(paths[-1]).write_bytes(shard)
        try:
            self.llm.collective_rpc("echo_reload_weights", args=(paths,))
        finally:
            for path in paths:
                os.unlink(path)
        self.llm.reset_prefix_cache()  # cached prompt keys/values were computed by the old weights

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        """Whole completions: `newer_weights` is not asked (partial rollouts are the HF engine's).
        With `draws`, a request per completion, each carrying its noise (KeyedNoise)."""
        from vllm import SamplingParams

        from echo.engines.vllm_worker import NOISE_ARG

        keyed = draws is not None and not greedy
        if not greedy and keyed != self.keyed:  # the engine's log-probs mode is the run's
            raise ValueError(f"this vLLM engine was built for sampling.noise = {'keyed' if self.keyed else 'engine'!r}")
        limit = max_tokens or self.max_new_tokens
        if keyed:
            low, high = key_halves([d.key for d in draws], torch.device("cpu"))
            params = [SamplingParams(temperature=0.0, max_tokens=limit, logprobs=0,
                                     stop_token_ids=[self.tokenizer.eos_token_id],
                                     extra_args={NOISE_ARG: [int(low[i]), int(high[i]), d.first + j, d.position,
                                                             self.temperature]})
                      for i, d in enumerate(draws) for j in range(n)]
            requests = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
            outputs = self.llm.generate(requests, params, lora_request=self.adapter, use_tqdm=False)
            completions = [self._generation(out.outputs[0], len(out.prompt_token_ids)) for out in outputs]
            return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]
        # Plain sampling at `temperature` (no top-k/top-p), as the trainer assumes; greedy for eval
        # (a keyed engine's greedy log-probs are raw logits: an evaluation does not read them).
        params = SamplingParams(n=n, temperature=0.0 if greedy else self.temperature, max_tokens=limit,
                                logprobs=0, stop_token_ids=[self.tokenizer.eos_token_id], seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=self.adapter,
                                    use_tqdm=False)
        return [[self._generation(c, len(out.prompt_token_ids)) for c in out.outputs] for out in outputs]

    def _generation(self, completion, prompt_tokens: int) -> CompletionOutput:
        ids = list(completion.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, completion.logprobs)]
        routing = None
        if self.routing:
            routing = routed_rows(completion.routed_experts, self.moe_layers, self.routing[1], prompt_tokens + len(ids))
        return CompletionOutput(token_ids=ids, logprobs=logprobs, text=completion.text,
                          finish_reason="stop" if completion.finish_reason == "stop" else "length", routing=routing)


def routed_rows(routed, moe_layers: list[int], top_k: int, tokens: int) -> np.ndarray:
    """vLLM's routed experts for one completion (CompletionOutput.routed_experts: (positions, every
    decoder layer, top_k), uint8 or uint16, over the prompt and the completion but its last token,
    which was never an input) as CompletionOutput.routing: the MoE layers' rows, the last row zeros."""
    routed = None if routed is None else np.asarray(routed)
    if routed is None or routed.ndim != 3 or routed.shape[0] not in (tokens - 1, tokens) \
            or routed.shape[1] <= max(moe_layers) or routed.shape[2] != top_k:
        raise RuntimeError(f"vLLM's routed experts {None if routed is None else routed.shape} do not fit "
                           f"{tokens} tokens of {len(moe_layers)} MoE layers, top-{top_k}")
    out = np.zeros((tokens, len(moe_layers), top_k), np.uint16)
    out[: tokens - 1] = routed[: tokens - 1, moe_layers]
    return out
