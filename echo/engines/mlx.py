"""The MLX engine (`sampler.engine = "mlx"`): generation with Apple's MLX through mlx-lm's models,
on a Mac's GPU (Metal) or, with `mlx[cpu]`, any machine's CPU. It runs the model mlx-lm builds
from the run's Hugging Face folder and the trainer's tokenizer, a LoRA adapter as mlx-lm's
LoRALinear (a PEFT version converted: A and B transposed, scale alpha / r), or every weight in
full-weight mode.

The forward is MLX's; the draw is the trainer's own code. Each step's last-position logits come
to the CPU as float32 and the token is drawn there by echo/trust/noise.py (keyed noise: the same bits
the trainer's proof draws again) or by torch's generator (the engine's noise, for a run that
trusts its samplers), with the behaviour log-prob of softmax(logits / T). A prompt's n
completions are one batch (the prompt repeated, so no padding: every row has the same length),
the end-of-sequence token kept.

Where the run replays a mixture of experts' routing, the experts each of mlx-lm's expert blocks
(SwitchGLU) is sent are kept a forward, as the HF engines record a router's: every prompt token's
and completion token's, the last token's row zeros (no forward took it as input).

One model over several processes (`sampler.ranks`, `group`: an MLX distributed group, ring
backend): mlx-lm's pipeline gives each rank a share of the decoder layers (rank 0 the last), in
proportion to the memory each offers (`layer_split`), and each loads only its own layers' weights
and adapter. Every rank's base model must be rank 0's, by digest. Rank 0 is the sampler, the only NATS client;
every call and every version it gets goes to the other ranks first (`_send`: the command as JSON
and bytes, never a pickle: the ring is plain TCP), which wait in `follow`. In generation every
rank runs its layers and the head; the token is rank 0's draw, sent to the others once a step, so
unlike hardware cannot diverge. While rank 0 waits on the others (a forward through their
layers, a collective), `waiting_since` says since when: a watchdog (workers/sampler/ranks.py)
reads it to tell a hung rank from a slow one.
A group's routing is then not recorded (each rank sees its own layers' experts only).

A model whose architecture mlx-lm does not have, or an MLX not installed, is refused at start in
one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import threading
import time

import numpy as np
import torch

from echo.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig
from echo.engines.base import CompletionOutput, NewerWeights
from echo.model.devices import DTYPES
from echo.model.loading import encode_chat, load_tokenizer, model_folder, model_on_meta
from echo.model.policy import make_policy
from echo.trust.noise import Draw, key_halves, keyed_draw
from echo.trust.routing import replayed_shape
from echo.weights.shards import check_tensors, policy_shapes, shards_tensors


def _mlx():
    """mlx.core and mlx_lm, imported. mlx-lm's utils set the process's open-file limits to
    (2048, 4096) on import, the hard limit included (lowered for good): the sampler's stay its own
    (a page test holding 2,000 sockets failed in the process after it)."""
    setrlimit = resource.setrlimit
    resource.setrlimit = lambda *limits: None
    try:
        import mlx.core as mx
        import mlx_lm
        import mlx_lm.utils  # noqa: F401  (the import that sets them)
    except ImportError:
        raise ConfigError("sampler.engine = 'mlx': MLX is not installed here; pip install 'echo-rl[mlx]' "
                          "(mlx with its CPU backend on Linux, Metal on a Mac)") from None
    finally:
        resource.setrlimit = setrlimit
    return mx, mlx_lm


def _config_overrides(folder) -> dict:
    """What mlx-lm reads under other names than transformers 5 writes in config.json: a top-level
    rope_theta (transformers writes it under rope_parameters; mlx-lm's default, 1e6, moved every
    logit), and a mixture of experts' num_experts (num_local_experts)."""
    config, out = json.loads((folder / "config.json").read_text()), {}
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if "num_experts" not in config and "num_local_experts" in config:
        out["num_experts"] = config["num_local_experts"]
    return out


def _expert_blocks(model) -> list:
    """A mixture of experts' expert blocks (mlx-lm's SwitchGLU), (decoder layer, block) in layer
    order; none in a dense model."""
    from mlx_lm.models.switch_layers import SwitchGLU

    return sorted(((int(re.search(r"layers\.(\d+)\.", path)[1]), m) for path, m in model.named_modules()
                   if isinstance(m, SwitchGLU)), key=lambda pair: pair[0])


@contextlib.contextmanager
def recorded(model):
    """Inside, each expert block's choices are kept: `calls[layer]` gets one (rows, tokens, k)
    array of expert ids a forward, the blocks in decoder-layer order. mlx-lm's blocks pass their
    chosen experts to SwitchGLU, whose call is wrapped for the while (the class's, as
    echo/trust/routing.py's paged_routing patches transformers')."""
    from mlx_lm.models.switch_layers import SwitchGLU

    blocks = _expert_blocks(model)
    index = {id(m): k for k, (_, m) in enumerate(blocks)}
    calls: list[list] = [[] for _ in blocks]
    original = SwitchGLU.__call__

    def keeping(self, x, indices):
        calls[index[id(self)]].append(indices)
        return original(self, x, indices)

    SwitchGLU.__call__ = keeping
    try:
        yield calls
    finally:
        SwitchGLU.__call__ = original


def _draw_as_list(value):
    """JSON for a call's draws (echo/trust/noise.py's Draw: key, first, position)."""
    if isinstance(value, Draw):
        return [value.key, value.first, value.position]
    raise TypeError(f"{type(value).__name__} is not sent between ranks")


class _FromRank0:
    """A following rank's NewerWeights: between chunks, what rank 0 swapped in (sent, then "go")."""

    def __init__(self, engine):
        self.engine = engine

    def between_chunks(self) -> int | None:
        return self.engine.follow(until="go")[1]


def layer_split(layers: int, memory: list[float]) -> list[int]:
    """Each rank's number of decoder layers (mlx-lm's pipeline's `split`, by rank), in proportion
    to the memory each offers: at least one each, the largest remainders taking what rounding
    leaves (the lower rank first on a tie, as mlx-lm's even split)."""
    ranks = len(memory)
    if not 1 <= ranks <= layers:
        raise ConfigError(f"sampler.ranks = {ranks}: the model has {layers} decoder layers, at least one a rank")
    weights = memory if all(m > 0 for m in memory) else [1.0] * ranks
    exact = [(layers - ranks) * w / sum(weights) for w in weights]
    split = [1 + int(e) for e in exact]
    for r in sorted(range(ranks), key=lambda r: (int(exact[r]) - exact[r], r))[: layers - sum(split)]:
        split[r] += 1
    return split


def _memory_gb() -> float:
    """This machine's memory for the model: a Mac's recommended working set for Metal, else its
    physical memory."""
    info = _mlx()[0].device_info()
    size = info.get("max_recommended_working_set_size") or info.get("memory_size")
    return (size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30


class MLXEngine:
    name = "mlx"
    keyed_noise = True

    def __init__(self, model: ModelConfig, lora: LoraConfig, sampling: SamplingConfig, record_routing: bool = False,
                 group=None, memory_gb: float = 0.0):
        model_name, device, dtype = model.name, model.device, model.dtype
        mx, _ = _mlx()
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.tuner.utils import linear_to_lora_layers
        from mlx_lm.utils import load_model

        if device not in ("auto", "cpu", "mps"):
            raise ConfigError(f"model.device = {device!r}: the mlx engine runs on 'cpu' or a Mac's GPU ('mps', 'auto')")
        self.mx, self._cache = mx, make_prompt_cache
        mx.set_default_device(mx.cpu if device == "cpu" or not mx.metal.is_available() else mx.gpu)
        self.device = torch.device("cpu")  # where the draw runs
        # float32 unless the run allows a 16-bit sampler and this one asks for it (auto: fp32 on a CPU)
        wanted = "float32" if dtype == "auto" and not mx.metal.is_available() else dtype
        if wanted == "auto":
            wanted = "bfloat16" if "bfloat16" in sampling.dtypes else "float32"
        if wanted not in sampling.dtypes:
            raise ConfigError(f"model.dtype {wanted!r}: sampling.dtypes {sampling.dtypes} do not allow it")
        self.dtype = DTYPES[wanted]
        folder = model_folder(model_name)
        self.group = group if group is not None and group.size() > 1 else None
        self.rank = 0 if self.group is None else self.group.rank()
        self.waiting_since: float | None = None
        self._calling = threading.RLock()  # rank 0's calls, one at a time: each a sequence of collectives
        self._followed = self.group is not None  # other ranks follow this one (till stop_followers)
        try:  # lazily: on several ranks each reads only its own layers' weights
            self.model, _ = load_model(folder, lazy=True, model_config=_config_overrides(folder))
        except (ValueError, TypeError, KeyError) as e:  # "Model type ... not supported.", a config it cannot read
            raise ConfigError(f"model.name {model_name!r}: mlx-lm cannot build it ({e}); "
                              "use sampler.engine = 'hf'") from None
        if self.group is not None:
            if record_routing:
                raise ConfigError("sampler.ranks > 1 records no mixture-of-experts routing (each rank sees its own "
                                  "layers' experts): a run with algorithm.router_replay = 'replay' samples unsplit")
            if not hasattr(self.model.model, "pipeline"):
                raise ConfigError(f"sampler.ranks = {self.group.size()}: mlx-lm cannot split {model_name!r} by layers "
                                  "(its pipeline covers qwen2, qwen3_moe, deepseek: not llama); use sampler.ranks = 1")
            self._same_base(model_name)
            memory = self._gathered(memory_gb or _memory_gb())
            self.model.model.pipeline(self.group, layer_split(len(self.model.model.layers), memory))
        mx.eval(self.model.parameters())
        inner = self.model.model  # the decoder layers this rank runs, [first, last + 1): mlx-lm's pipeline's
        self.layers = (getattr(inner, "start_idx", 0), getattr(inner, "end_idx", None) or len(inner.layers))
        if wanted != "float32":
            if mx.default_device().type == mx.cpu and _expert_blocks(self.model):
                raise ConfigError(f"model.dtype {wanted!r}: MLX's CPU backend multiplies a mixture of experts' "
                                  "experts (GatherMM) in float32 only; use model.dtype = 'float32' here (a Mac's GPU "
                                  f"takes {wanted})")
            self.model.set_dtype(getattr(mx, wanted))
        self.tokenizer = load_tokenizer(model_name)
        self.lora = lora if lora.enabled else None
        if self.lora is not None:
            keys = sorted({path.split("layers.", 1)[1].split(".", 1)[1] for path, _ in self._linears()
                           if path.rsplit(".", 1)[-1] in lora.target_modules})
            if not keys:
                raise ConfigError(f"lora.target_modules {lora.target_modules} match no layer of {model_name!r} "
                                  "in mlx-lm")
            linear_to_lora_layers(self.model, len(self.model.model.layers),
                                  {"rank": lora.r, "scale": lora.alpha / lora.r, "dropout": 0.0, "keys": keys})
        self.model.eval()
        # What the trainer publishes for this model (its own definition), which must map onto this
        # model's parameters one for one: a mixture of experts' stacked experts under LoRA do not.
        on_meta = model_on_meta(model_name)
        # A mixture of experts' routing shape, where its routing is recorded for the trainer to replay
        self.routing = replayed_shape(on_meta, model_name, record_routing)
        self.shapes = policy_shapes(make_policy(on_meta, lora))
        expected = {k: v for k, v in self.shapes.items() if self._holds(k)}  # this rank's share (all, unsplit)
        mine = self._published_shapes()
        if mine != expected:
            missing, extra = sorted(expected.keys() - mine.keys())[:2], sorted(mine.keys() - expected.keys())[:2]
            raise ConfigError(f"model.name {model_name!r}: the weights the trainer publishes do not map onto mlx-lm's "
                              f"model (not here: {missing}; only here: {extra}); use sampler.engine = 'hf'")
        self.temperature = sampling.temperature
        self.max_new_tokens, self.chunk_tokens = sampling.max_new_tokens, sampling.chunk_tokens
        # each rank's weights in MB, by rank (what the split buys); one rank: the whole model's
        self.rank_mb = self._gathered(self._held_mb())

    def _held_mb(self) -> float:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters())) / 2**20

    def memory_mb(self) -> list[tuple[float, float]]:
        """Rank 0: each rank's MLX memory in MB, by rank: (held now, the most held since it was
        last asked); asking starts the count again. The memory of a call is the second after it
        less the first before it (a process's count: another MLX engine in it counts too)."""
        with self._calling:
            self._send(("memory",))
            return self._memory_mb()

    def _memory_mb(self) -> list[tuple[float, float]]:
        mx = self.mx
        held, most = mx.get_active_memory() / 2**20, mx.get_peak_memory() / 2**20
        mx.reset_peak_memory()
        return list(zip(self._gathered(held), self._gathered(most)))

    def _holds(self, name: str) -> bool:
        """Whether this rank holds the published tensor `name` (a layer's: by its number; the rest,
        the embeddings, norm and head, every rank)."""
        layer = re.search(r"layers\.(\d+)\.", name)
        return layer is None or self.layers[0] <= int(layer[1]) < self.layers[1]

    def _same_base(self, model_name: str) -> None:
        """Every rank's base model is rank 0's, by content (ranks on other machines keep their own
        copies): one that differs stops at start."""
        from echo.model.loading import base_model_digest

        mine = base_model_digest(model_name)
        (_, theirs), _ = self._broadcast(("base", mine))
        if theirs != mine:
            raise ConfigError(f"model.name {model_name!r}: this rank's copy differs from rank 0's "
                              f"(digest {mine[:12]}, rank 0's {theirs[:12]}): give every rank the same model")

    def _gathered(self, value: float) -> list[float]:
        """Every rank's `value`, by rank, on every rank."""
        mx = self.mx
        if self.group is None:
            return [value]
        mine = np.zeros(self.group.size(), np.float32)
        mine[self.rank] = value
        return np.array(mx.distributed.all_sum(mx.array(mine), group=self.group)).tolist()

    @contextlib.contextmanager
    def _waiting(self):
        """Rank 0 waits on the other ranks inside: `waiting_since` says since when."""
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None

    def _linears(self):
        import mlx.nn as nn

        return [(path, m) for path, m in self.model.named_modules() if isinstance(m, nn.Linear) and "layers." in path]

    def _published_shapes(self) -> dict[str, torch.Size]:
        """The names and shapes of what a version publishes for this model (echo/model/policy.py's
        policy_tensors): PEFT's adapter names, or every parameter."""
        from mlx.utils import tree_flatten

        flat = dict(tree_flatten(self.model.parameters()))
        if self.lora is None:
            return {k: torch.Size(v.shape) for k, v in flat.items() if self._holds(k)}
        shapes = {}
        for k, v in flat.items():
            if k.endswith(".lora_a"):  # (in, r): PEFT's A is (r, in)
                shapes[f"base_model.model.{k[: -len('.lora_a')]}.lora_A.weight"] = torch.Size(v.shape[::-1])
            elif k.endswith(".lora_b"):  # (r, out): PEFT's B is (out, r)
                shapes[f"base_model.model.{k[: -len('.lora_b')]}.lora_B.weight"] = torch.Size(v.shape[::-1])
        return shapes

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def load_weights(self, shards: list[bytearray]) -> None:
        """Swap a published version in place (a LoRA adapter's A and B, or every weight), or raise
        WeightsMismatch with the current weights kept: every name and shape is checked first (on
        rank 0, before any other rank is sent them)."""
        incoming = shards_tensors(shards)
        check_tensors(self.shapes, incoming)
        with self._calling:
            self._send(("load",), [bytes(s) for s in shards])
            self._load(incoming)

    def _load(self, incoming: dict[str, torch.Tensor]) -> None:
        mx = self.mx
        pairs = []
        for key, tensor in incoming.items():
            if not self._holds(key):
                continue
            value = tensor.float().numpy()
            if self.lora is not None:
                path, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
                key, value = f"{path}.lora_{which[0].lower()}", value.T
            pairs.append((key, mx.array(value)))
        self.model.load_weights(pairs, strict=False)
        if self.dtype != torch.float32 and self.lora is None:
            self.model.set_dtype(mx.bfloat16 if self.dtype == torch.bfloat16 else mx.float16)
        mx.eval(self.model.parameters())

    # --- several ranks: rank 0 leads, the others follow -----------------------------------------

    def _send(self, command: tuple, blobs: list[bytes] = ()) -> None:
        """Rank 0: `command` (JSON-able) and `blobs` to every other rank (nothing on one rank, nor
        on the others: they follow)."""
        if self.group is not None and self.rank == 0:
            self._broadcast(command, blobs)

    def _broadcast(self, command: tuple = (), blobs: list[bytes] = ()) -> tuple[list, list[bytes]]:
        """Rank 0's command and blobs, on every rank: its bytes summed with the others' zeros (two
        all_sums: their length, then the bytes), a JSON head naming the blobs' sizes, then the
        blobs. JSON, not a pickle: the ring is plain TCP, and what arrives is data, never code."""
        mx = self.mx
        data = b""
        if self.rank == 0:
            head = json.dumps([list(command), [len(b) for b in blobs]], default=_draw_as_list).encode()
            data = b"".join([len(head).to_bytes(4, "little"), head, *blobs])
        with self._waiting():
            length = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=self.group).item()
            payload = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.rank == 0 else mx.zeros((length,), mx.uint8)
            data = bytes(np.array(mx.distributed.all_sum(payload, group=self.group)))
        size = int.from_bytes(data[:4], "little")
        command, sizes = json.loads(data[4 : 4 + size])
        blobs, at = [], 4 + size
        for n in sizes:
            blobs.append(data[at : at + n])
            at += n
        return command, blobs

    def follow(self, until: str = "stop"):
        """A rank other than 0: do what rank 0 sends (a version to load, a call to generate) until
        it sends `until` (a call's chunk boundary: "go"; the end: "stop"); returns that command."""
        while True:
            command, blobs = self._broadcast()
            if command[0] == until:
                return command
            if command[0] == "load":  # else "ping": nothing to do
                self._load(shards_tensors([bytearray(b) for b in blobs]))
            elif command[0] == "memory":
                self._memory_mb()
            elif command[0] == "generate":
                prompts, n, greedy, max_tokens, seed, draws, chunked = command[1:]
                draws = None if draws is None else [Draw(*d) for d in draws]
                self._generate(prompts, n, greedy, max_tokens, seed, draws, _FromRank0(self) if chunked else None)

    def stop_followers(self) -> None:
        """Rank 0, at the end: the other ranks leave `follow` (and no ping follows)."""
        with self._calling:
            self._send(("stop",))
            self._followed = False

    def _token(self, token: torch.Tensor) -> torch.Tensor:
        """Rank 0's drawn tokens, on every rank (one all_sum a step)."""
        if self.group is None:
            return token
        mine = token.numpy().astype(np.int32) if self.rank == 0 else np.zeros(len(token), np.int32)
        with self._waiting():
            return torch.from_numpy(np.array(self.mx.distributed.all_sum(self.mx.array(mine), group=self.group)))

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 newer_weights: NewerWeights | None = None, max_tokens: int | None = None,
                 seed: int | None = None, draws: list[Draw] | None = None) -> list[list[CompletionOutput]]:
        """n completions a prompt, each prompt's n in one batch (see the module's docstring)."""
        with self._calling:
            self._send(("generate", prompts, n, greedy, max_tokens, seed, draws, newer_weights is not None))
            return self._generate(prompts, n, greedy, max_tokens, seed, draws, newer_weights)

    def ping(self) -> bool:
        """Rank 0, between calls: one round trip through every rank, so that a rank hung while the
        sampler is idle is noticed too. False, doing nothing, while a call is under way (its own
        waits are watched)."""
        if not self._calling.acquire(blocking=False):
            return False
        try:
            if not self._followed:
                return False
            self._send(("ping",))
        finally:
            self._calling.release()
        return True

    def _generate(self, prompts: list[list[int]], n: int, greedy: bool, max_tokens: int | None, seed: int | None,
                  draws: list[Draw] | None, newer_weights: NewerWeights | None = None) -> list[list[CompletionOutput]]:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        limit = self.max_new_tokens if max_tokens is None else max_tokens
        out = []
        for k, prompt in enumerate(prompts):
            draw = None if draws is None or greedy else draws[k]
            out.append(self._one_prompt(prompt, n, limit, greedy, draw, generator, newer_weights))
        return out

    def _one_prompt(self, prompt: list[int], n: int, limit: int, greedy: bool, draw: Draw | None,
                    generator: torch.Generator | None, newer_weights: NewerWeights | None) -> list[CompletionOutput]:
        mx, eos = self.mx, self.tokenizer.eos_token_id
        cache, routed = self._cache(self.model), []  # routed: each forward's (rows, tokens, layers, k)

        def forward(inputs):
            with recorded(self.model) if self.routing else contextlib.nullcontext() as calls:
                logits = self.model(inputs, cache=cache)[:, -1, :]
            if self.routing:
                routed.append(np.stack([np.array(c[0]).reshape(n, -1, c[0].shape[-1]) for c in calls], axis=2))
            return logits

        logits = forward(mx.array([prompt] * n))
        if draw is not None:
            low, high = key_halves([draw.key] * n, self.device)
            completion = torch.arange(draw.first, draw.first + n)
        tokens, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        changes: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        going = list(range(n))
        for step in range(limit):
            with self._waiting():  # split, the forward runs through every rank's layers here (MLX is lazy)
                scores = torch.from_numpy(np.array(logits.astype(mx.float32))) / self.temperature
            if draw is not None:
                _, token, logprob = keyed_draw(scores, low, high, completion, torch.full((n,), draw.position + step))
            else:
                token = (scores.argmax(-1) if greedy
                         else torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(-1))
                logprob = torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
            token = self._token(token)
            for row in going:
                tokens[row].append(int(token[row]))
                logprobs[row].append(float(logprob[row]))
            going = [row for row in going if tokens[row][-1] != eos]
            if not going or step + 1 == limit:
                break
            if newer_weights is not None and self.chunk_tokens and (step + 1) % self.chunk_tokens == 0:
                version = newer_weights.between_chunks()  # the cache is kept, as generation keeps it
                self._send(("go", version))  # after the version it swapped in, if any
                if version is not None:
                    for row in going:
                        changes[row].append((step + 1, version))
            # Every row goes on (a finished one's tokens are not read): the batch keeps one length.
            logits = forward(mx.array(token.numpy().astype(np.int32))[:, None])
        routing = np.concatenate(routed, axis=1).astype(np.uint16) if self.routing else None
        return [CompletionOutput(token_ids=t, logprobs=lp, text=self.tokenizer.decode(t, skip_special_tokens=True),
                           finish_reason="stop" if t[-1] == eos else "length", version_changes=tuple(c),
                           routing=None if routing is None else _row_routing(routing[row], len(prompt) + len(t)))
                for row, (t, lp, c) in enumerate(zip(tokens, logprobs, changes))]


def _row_routing(forwards: np.ndarray, tokens: int) -> np.ndarray:
    """A completion's routing over its prompt and its tokens: the last token, which no forward took
    as input, a row of zeros (a finished row was fed on with the batch: those rows are dropped)."""
    return np.concatenate([forwards[: tokens - 1], np.zeros((1, *forwards.shape[1:]), np.uint16)])
