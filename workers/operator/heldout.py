"""`echo-rl eval`: score the base model and a run's last published weights on the task's
held-out set, with greedy decoding, so the two numbers differ only by what training changed
(the parity bench also scores by sampling: held_out_score's `samples`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import structlog

from echo.checkpoint import latest_weights, read_shards
from echo.config import EchoConfig
from echo.engines import make_engine
from echo.environments import play_episodes
from echo.logs import Progress
from echo.tasks import is_environment, load_task

log = structlog.get_logger()


def held_out_score(engine, task, prompts, max_tokens: int, batch: int = 8, samples: int = 0,
                   seed: int = 0) -> tuple[float, float]:
    """(mean reward, share correct) of the engine's current weights on `prompts`: greedy, or with
    `samples`, over that many completions sampled for each prompt, drawn with `seed` (the same
    draws for every version scored): the policy's expected reward. A multi-turn task's episodes
    are played to their end; one is correct when it earned the whole reward (1)."""
    scores, n, greedy = [], max(samples, 1), samples == 0
    with Progress("held-out", len(prompts), " prompts") as progress:
        for call, start in enumerate(range(0, len(prompts), batch)):
            chunk = prompts[start : start + batch]
            ids = [engine.encode_chat(p.messages) for p in chunk]
            draw = None if greedy else seed + call
            if is_environment(task):
                episodes = play_episodes(engine, task, chunk, ids, n, max_tokens, greedy=greedy, seed=draw)
                scores += [(e.reward, e.reward >= 1.0 - 1e-9) for played in episodes for e in played]
            else:
                outputs = engine.generate(ids, n, greedy=greedy, seed=draw)
                scores += [(s.reward, s.correct) for out, p in zip(outputs, chunk)
                           for s in (task.score(o.text, p) for o in out)]
            progress.advance(len(chunk))
    return sum(r for r, _ in scores) / len(scores), sum(c for _, c in scores) / len(scores)


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
