"""The transformers engine: peft LoRA on top of the base model (or the plain model in full-weight
mode), generation with `generate`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import ClassVar

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from echo.config import LoraConfig, SamplingConfig
from echo.engines.base import CompletionOutput, NewerWeights
from echo.model.devices import resolve_device, sampler_dtype
from echo.model.loading import encode_chat, load_model
from echo.model.policy import CACHE, kv_cache, make_policy
from echo.trust.noise import Draw, key_halves, keyed_draw, noisy_scores
from echo.trust.routing import recorded, replayed_shape
from echo.weights.shards import load_weights


class SampledLogprobs(LogitsProcessor):
    """Each sampled token's behaviour log-prob, its log-softmax(logits / T), one step at a time:
    a step's log-probs are kept until the next call shows which token was drawn from them.
    `generate(output_logits=True)` kept every step's logits instead: 16 completions of 16k
    tokens over a 49k vocabulary is ~51 GB for one call; this holds one step's.

    generate runs a processor given to it before its sampling warpers (temperature): it sees
    the model's logits as they are."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.last: torch.Tensor | None = None  # the latest step's log-probs, (rows, vocab)
        self.steps: list[torch.Tensor] = []  # (rows,) for each step whose token is known

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.last is not None:  # the token drawn at the previous step is the last input
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Every step's log-probs, (rows, steps), given each row's last generated token."""
        self.steps.append(self.last.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
        return torch.stack(self.steps, dim=1)


class KeyedNoise(SampledLogprobs):
    """Gumbel-max sampling with keyed noise (echo/trust/noise.py), under greedy decoding: each step's
    scores become logits / T + g, whose argmax is the token. Row i of the batch is completion
    `rows[i][1]` of the group keyed `rows[i][0]`, its first step at position `rows[i][2]`; the
    call's first step is `start` steps past those."""

    def __init__(self, temperature: float, rows: list[tuple[int, int, int]], start: int, device: torch.device):
        super().__init__(temperature)
        self.low, self.high = key_halves([key for key, _, _ in rows], device)
        self.completion = torch.tensor([j for _, j, _ in rows], dtype=torch.int64, device=device)
        self.position = torch.tensor([at for _, _, at in rows], dtype=torch.int64, device=device) + start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        super().__call__(input_ids, scores)
        noisy = noisy_scores(scores.float() / self.temperature, self.low, self.high, self.completion, self.position)
        self.position = self.position + 1
        return noisy


class PagedKeyedNoise(LogitsProcessor):
    """KeyedNoise for transformers' continuous batching (PagedEngine): a call's requests are
    `req_<i>` in the order given, request i completion `rows[i][1]` of the group keyed
    `rows[i][0]`, its first step at position `rows[i][2]`. The manager builds its processors from
    the model's `_get_logits_processor`, and gives a processor of its own kind a per-request
    argument only when it converts a plain one (ContinuousBatchingLogitsProcessorList): this one
    stands for `_PagedKeyedDraws`, which does the work. The behaviour log-prob of each drawn
    token, log-softmax(logits / T), is kept by request and step: the manager's own are those of
    the noisy scores it is given."""

    supports_continuous_batching = True

    def __init__(self, temperature: float, rows: list[tuple[int, int, int]], max_tokens: int, device: torch.device):
        self.temperature = temperature
        self.low, self.high = key_halves([key for key, _, _ in rows], device)
        self.completion = torch.tensor([j for _, j, _ in rows], dtype=torch.int64, device=device)
        self.first = torch.tensor([at for _, _, at in rows], dtype=torch.int64, device=device)
        self.drawn = torch.zeros(len(rows), dtype=torch.int64, device=device)  # tokens each request has drawn
        self.logprobs = torch.zeros((len(rows), max_tokens), device=device)

    def __call__(self, input_ids, scores):  # the manager calls _PagedKeyedDraws instead
        raise TypeError("PagedKeyedNoise runs only inside transformers' continuous batching (PagedEngine)")


def _paged_keyed_draws():
    """The continuous-batching processor PagedKeyedNoise stands for, registered with the
    manager's map of per-request processors; None where this transformers has no such API (the
    paged engine then draws no keyed noise)."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import cb_logits_processors as cb
    except ImportError:
        return None
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if not hasattr(cb, "CLASSIC_TO_CB_PROCESSORS_MAP") or not {"per_request_processors", "use_async_batching"} <= fields:
        return None

    class _PagedKeyedDraws(cb.ContinuousBatchingLogitsProcessor):
        supported_kwargs: ClassVar[dict[str, type]] = {}
        ignored_kwargs: tuple[str, ...] = ()

        def __init__(self, keyed: PagedKeyedNoise):
            self.keyed = keyed

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            # Each row's request: its index in the call (the manager names them req_<i>).
            return torch.tensor([int(r.state.request_id.removeprefix("req_")) for r in requests_with_new_token],
                                dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            k, requests = self.keyed, tensor_arg[: scores.size(0)].long()
            noisy, _, logprob = keyed_draw(scores.float() / k.temperature, k.low[requests], k.high[requests],
                                           k.completion[requests], k.first[requests] + k.drawn[requests])
            k.logprobs[requests, k.drawn[requests]] = logprob  # the manager's greedy argmax takes the drawn token
            k.drawn[requests] += 1
            return noisy

    cb.CLASSIC_TO_CB_PROCESSORS_MAP[PagedKeyedNoise] = _PagedKeyedDraws
    return _PagedKeyedDraws


PAGED_KEYED = _paged_keyed_draws() is not None


class HFEngine:
    name = "hf"
    keyed_noise = True  # draws with sampling.noise = "keyed"

    def __init__(self, model_name: str, lora: LoraConfig, sampling: SamplingConfig, device: str = "auto",
                 dtype: str = "auto", record_routing: bool = False):
        self.device = resolve_device(device)
        self.dtype = sampler_dtype(dtype, self.device, sampling.dtypes)
        base, self.tokenizer = load_model(model_name, self.device, self.dtype)
        # peft keeps the adapter in fp32 over a 16-bit base; published weights are cast on load.
        self.model = make_policy(base, lora).eval()
        # A mixture of experts' routing shape, where its routing is recorded for the trainer to replay
        # (echo/trust/routing.py); None: not recorded.
        self.routing = replayed_shape(self.model, model_name, record_routing)
        self.temperature = sampling.temperature
        self.max_new_tokens, self.chunk_tokens = sampling.max_new_tokens, sampling.chunk_tokens
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
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def load_weights(self, shards: list[bytearray]) -> None:
        load_weights(self.model, shards)

    def call_config(self, greedy: bool) -> GenerationConfig:
        config = copy.deepcopy(self.generation_config)
        if greedy:  # evaluation: the log-probs are then those of the tempered distribution, unused
            config.do_sample = False
            config.temperature, config.top_k, config.top_p = None, None, None
        return config

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        """With `newer_weights`, generation goes `chunk_tokens` at a time and asks it between
        chunks, where the sampler may swap in newer weights: the completions go on from the key/value
        cache as it is (the partial rollouts of PipelineRL), and each says where a version took over.
        With `draws` (one per prompt), tokens are drawn by Gumbel-max with keyed noise, not `seed`."""
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.device)
        if seed is not None:  # generate draws from torch's global generator (one sampler a process)
            torch.manual_seed(seed)
        keyed = draws is not None and not greedy
        config = self.call_config(greedy or keyed)  # keyed: the argmax of the noisy scores
        limit = self.max_new_tokens if max_tokens is None else max_tokens
        chunk = self.chunk_tokens if newer_weights is not None and self.chunk_tokens else limit
        ids, mask = batch["input_ids"].repeat_interleave(n, 0), batch["attention_mask"].repeat_interleave(n, 0)
        rows = list(range(ids.shape[0]))  # the completions still being generated
        tokens, logprobs = [[] for _ in rows], [[] for _ in rows]
        changes: list[list[tuple[int, int]]] = [[] for _ in rows]
        produced, cache, eos = 0, None, self.tokenizer.eos_token_id
        routed: list[list[torch.Tensor]] = [[] for _ in rows]  # each row's routing, a chunk at a time
        while True:
            config.max_new_tokens = min(chunk, limit - produced)
            noise_rows = [(d.key, d.first + row % n, d.position) for row in rows for d in [draws[row // n]]] if keyed else []
            sampled = (KeyedNoise(self.temperature, noise_rows, produced, self.device) if keyed
                       else SampledLogprobs(self.temperature))
            with recorded(self.model) if self.routing else contextlib.nullcontext() as calls:
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          **{CACHE: cache}, logits_processor=LogitsProcessorList([sampled]))
            if self.routing:
                for row, routing in zip(rows, chunk_routing(calls, len(rows))):
                    routed[row].append(routing)
            new_tokens = out.sequences[:, ids.shape[1]:]
            chunk_logprobs = sampled.finish(new_tokens[:, -1]).cpu()
            going = []
            for i, row in enumerate(rows):
                ids_i = new_tokens[i].tolist()
                end = ids_i.index(eos) + 1 if eos in ids_i else len(ids_i)
                tokens[row] += ids_i[:end]
                logprobs[row] += chunk_logprobs[i, :end].tolist()
                if eos not in ids_i:
                    going.append(i)
            produced += new_tokens.shape[1]
            if not going or produced >= limit:
                break
            version = newer_weights.between_chunks()
            keep = torch.tensor(going, device=self.device)
            cache = kv_cache(out)
            cache.batch_select_indices(keep)  # the finished completions leave the batch
            ids, mask = out.sequences[keep], torch.cat([mask, torch.ones_like(new_tokens)], dim=1)[keep]
            rows = [rows[i] for i in going]
            if version is not None:
                for row in rows:
                    changes[row].append((produced, version))
        padded = batch["input_ids"].shape[1]
        generations = [
            CompletionOutput(token_ids=t, logprobs=lp, text=self.tokenizer.decode(t, skip_special_tokens=True),
                       finish_reason="stop" if t[-1] == eos else "length", version_changes=tuple(c),
                       routing=row_routing(r, padded - len(prompts[row // n]), len(prompts[row // n]) + len(t))
                       if self.routing else None)
            for row, (t, lp, c, r) in enumerate(zip(tokens, logprobs, changes, routed))
        ]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]


def chunk_routing(calls: list[list[torch.Tensor]], rows: int) -> torch.Tensor:
    """One generate call's recorded routing, (rows, positions, layers, top_k): each forward routed
    rows x its new positions, flattened row by row."""
    return torch.stack([torch.cat([c.view(rows, -1, c.shape[-1]) for c in layer], dim=1) for layer in calls], dim=2)


def row_routing(chunks: list[torch.Tensor], padding: int, tokens: int) -> np.ndarray:
    """A completion's routing from its chunks: its prompt's tokens (the left padding dropped) and
    its own, the last of which no forward took as input (a row of zeros)."""
    routing = torch.cat(chunks)[padding : padding + tokens - 1]
    return np.concatenate([routing.numpy().astype(np.uint16), np.zeros((1, *routing.shape[1:]), np.uint16)])


class PagedEngine(HFEngine):
    """transformers' continuous batching over a paged key/value cache (`generate_batch`): each
    completion joins the batch, generates and leaves on its own, with no padding, and the
    completions of a group share their prompt's cache blocks. Its behaviour log-probs are those
    of softmax(logits / T), as `hf`'s. A call builds its own manager and cache, sized for the
    call, so keys and values computed under one version never serve the next. Whole
    completions: partial rollouts (sampling.chunk_tokens) need `hf`."""

    name = "hf"  # on the wire: transformers sampled it, with the same model code and log-probs as `hf`
    keyed_noise = PAGED_KEYED  # through the manager's per-request processors (PagedKeyedNoise)
    PAGE_TOKENS = 32
    MAX_BATCH_TOKENS = 8192  # tokens in one forward: prompts are prefilled in slices of this

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        keyed = draws is not None and not greedy
        if keyed and not self.keyed_noise:
            raise ValueError("this transformers' paged engine draws no keyed noise: sampling.noise = 'engine' "
                             "(make_engine says so)")
        limit = self.max_new_tokens if max_tokens is None else max_tokens
        requests = [prompt for prompt in prompts for _ in range(n)]
        config = self.call_config(greedy or keyed)  # keyed: the argmax of the noisy scores
        config.max_new_tokens = limit
        # Sized for this call: left to itself the manager sizes its cache from the device's free
        # memory, gigabytes on a CPU (a call then took 40 s instead of 1).
        pages = sum(-(-(len(prompt) + limit) // self.PAGE_TOKENS) for prompt in requests)
        # transformers 5.17 (the GPU machine's) names the page `block_size`; later ones `page_size`.
        fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        page = "page_size" if "page_size" in fields else "block_size"
        sampled = PagedKeyedNoise(self.temperature, [(d.key, d.first + i % n, d.position) for i in range(len(requests))
                                                     for d in [draws[i // n]]], limit, self.device) if keyed else None
        batching = ContinuousBatchingConfig(
            return_logprobs=not keyed, seed=seed, num_blocks=pages + 1, **{page: self.PAGE_TOKENS},
            max_batch_tokens=min(self.MAX_BATCH_TOKENS, max(256, sum(map(len, requests)))), use_cuda_graph=False,
            # keyed: the processor's Python runs at each step (no graph replays it) on its own request ids
            **({"per_request_processors": True} if keyed else {}),
            # one forward after another: a forward's routing is read against the layout prepared for it
            **({"use_async_batching": False} if keyed or self.routing else {}))
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if keyed:  # the manager asks the model for its processors: this call's, then the class's again
            model._get_logits_processor = lambda generation_config: LogitsProcessorList([sampled])
        try:
            with paged_routing(model, len(requests)) if self.routing else contextlib.nullcontext() as routed:
                out = model.generate_batch(requests, generation_config=config, continuous_batching_config=batching,
                                           warmup=False)
        finally:
            model.__dict__.pop("_get_logits_processor", None)
        if sorted(out) != sorted(f"req_{i}" for i in range(len(requests))) or any(o.error for o in out.values()):
            errors = [o.error for o in out.values() if o.error]
            raise RuntimeError(f"continuous batching returned {len(out)} of {len(requests)} completions: {errors[:1]}")
        out = [out[f"req_{i}"] for i in range(len(requests))]
        if keyed:
            for i, o in enumerate(out):
                o.logprobs = sampled.logprobs[i, : len(o.generated_tokens)].tolist()
        eos = self.tokenizer.eos_token_id
        generations = [
            CompletionOutput(token_ids=list(o.generated_tokens), logprobs=list(o.logprobs),
                       text=self.tokenizer.decode(o.generated_tokens, skip_special_tokens=True),
                       finish_reason="stop" if o.generated_tokens[-1] == eos else "length",
                       routing=routed.of(i, i - i % n, len(requests[i]) + len(o.generated_tokens)) if self.routing
                       else None)
            for i, o in enumerate(out)
        ]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]


class PagedRouting:
    """What continuous batching's forwards routed, request by request: each forward packs the
    scheduled requests' tokens one after another (`query_length` of each, at its positions from
    `past_length`), so the routers' choices, token by token, go back to their requests' rows."""

    def __init__(self, requests: int):
        self.rows: list[dict[int, np.ndarray]] = [{} for _ in range(requests)]  # position -> (layers, top_k)
        self.layouts: list[list[tuple[int, int, int]]] = []  # each forward's (request, past_length, query_length)

    def add(self, calls: list[list[torch.Tensor]]) -> None:
        """The forwards' choices (`recorded`: a (tokens, top_k) tensor a layer a forward), each against its layout."""
        for forward, layout in enumerate(self.layouts):
            ids = torch.stack([layer[forward] for layer in calls], 1).numpy().astype(np.uint16)
            start = 0
            for request, past, length in layout:
                for j in range(length):
                    self.rows[request][past + j] = ids[start + j]
                start += length

    def of(self, request: int, first: int, tokens: int) -> np.ndarray:
        """A request's routing over its prompt and completion (`tokens`), the last row zeros; a
        prompt shared with the requests from `first` on (its group) is prefilled once: its rows
        from whichever request did."""
        some = next(iter(self.rows[request].values()))
        out = np.zeros((tokens, *some.shape), np.uint16)
        for position in range(tokens - 1):
            row = self.rows[request].get(position)
            out[position] = row if row is not None else next(r[position] for r in self.rows[first:] if position in r)
        return out


@contextlib.contextmanager
def paged_routing(model, requests: int):
    """Inside, a generate_batch call's routing is kept (PagedRouting), read once it returns. The
    layouts are caught on transformers' class for the call (its instance is made inside
    generate_batch), so a process generates with one paged engine at a time while one records:
    a sampler's one engine does."""
    from transformers.generation.continuous_batching import input_outputs

    routed = PagedRouting(requests)
    prepare = input_outputs.ContinuousBatchingIOs.prepare_batch_tensors

    def prepare_and_keep(self, requests_in_batch, *args, **kwargs):
        routed.layouts.append([(int(f.state.request_id.removeprefix("req_")), f.state.position_offset, f.query_length)
                               for f in requests_in_batch])
        return prepare(self, requests_in_batch, *args, **kwargs)

    input_outputs.ContinuousBatchingIOs.prepare_batch_tensors = prepare_and_keep
    try:
        with recorded(model) as calls:
            yield routed
        routed.add(calls)
    finally:
        input_outputs.ContinuousBatchingIOs.prepare_batch_tensors = prepare
