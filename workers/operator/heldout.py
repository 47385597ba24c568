"""`echo-rl eval`: score the base model and a run's last published weights on the task's
held-out set, with greedy decoding, so the two numbers differ only by what training changed
(echo/train/heldout.py scores; the parity bench also scores by sampling)."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import structlog

from echo.config import EchoConfig
from echo.engines import make_engine
from echo.tasks import load_task
from echo.train.heldout import held_out_score
from echo.weights.files import latest_weights, read_shards

log = structlog.get_logger()


def evaluate(cfg: EchoConfig, version: int, shards: list[Path], n: int, batch: int = 8) -> dict:
    engine = make_engine(cfg)
    task = load_task(cfg.task)
    prompts = task.held_out(n)
    held_out = getattr(task, "held_out_source", "")
    if not prompts:
        raise ValueError(f"task {task.name!r} holds out no prompts to score{': ' + held_out if held_out else ''}")
    # A task may hold out fewer than asked: said why.
    log.info("eval.start", prompts=len(prompts), asked=n, decoding="greedy",
             **({"held_out": held_out} if len(prompts) < n and held_out else {}))
    max_tokens = cfg.sampling.max_new_tokens
    base_reward, base_correct = held_out_score(engine, task, prompts, max_tokens, batch)  # the base model first
    engine.load_weights(read_shards(shards))
    trained_reward, trained_correct = held_out_score(engine, task, prompts, max_tokens, batch)
    return {
        "task": task.name,
        "prompts": len(prompts),
        "version": version,
        "base_reward": round(base_reward, 4),
        "base_correct": round(base_correct, 4),
        "trained_reward": round(trained_reward, 4),
        "trained_correct": round(trained_correct, 4),
    }


def evaluate_run(run_dir: Path, n: int, overrides: list[str] = (), keep_earlier: bool = False) -> dict:
    """Scores the run's last weights into <run>/eval.json; `keep_earlier`: into the first free
    eval-K.json if there is one already (`echo-rl eval` after `up`: the run's own result stays)."""
    from echo.config import load_config

    cfg = load_config(run_dir / "config.toml", overrides)
    result = evaluate(cfg, *latest_weights(run_dir), n)
    out = run_dir / "eval.json"
    if keep_earlier:
        out = next(p for k in itertools.count(1) if not (p := run_dir / (f"eval-{k}.json" if k > 1 else "eval.json")).exists())
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    log.info("eval.done", file=str(out), **result)
    if cfg.run.trackers:  # beside the steps, in the run's own tracker runs (continued, as by a restarted trainer)
        from workers.trainer.trackers import Trackers

        trackers = Trackers(cfg)
        trackers.log(result["version"], {f"eval/{k}": float(v) for k, v in result.items()
                                         if k not in ("task", "version")})
        trackers.close()
    return result
