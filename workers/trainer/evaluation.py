"""Evaluation during training (`run.eval_every`, as verl's test_freq and TRL's eval_steps): every
so many steps the version just published is scored on `run.eval_prompts` held-out prompts, greedy,
as `echo-rl eval` scores it (echo/train/heldout.py).

It runs on the trainer's machine, between steps: an engine of the samplers' kind, made at the
first evaluation, is loaded with the version's published shards (the weights the samplers run,
on every trainer layout: one rank or several, LoRA or full weights). The learner waits for it
(`time/phase/evaluate`); the samplers go on generating meanwhile."""

from __future__ import annotations

import time

import orjson
import structlog

from echo.config import EchoConfig
from echo.engines import make_engine
from echo.train.heldout import held_out_score
from echo.weights.files import read_shards, weights_at

log = structlog.get_logger()


class Evaluator:
    def __init__(self, cfg: EchoConfig, task):
        self.cfg, self.task = cfg, task
        self.prompts = task.held_out(cfg.run.eval_prompts) if cfg.run.eval_every and cfg.run.eval_prompts else []
        self.engine = None  # made at the first evaluation: a run that never evaluates loads no second model
        if cfg.run.eval_every and cfg.run.eval_prompts and len(self.prompts) < cfg.run.eval_prompts:
            log.warning("eval.fewer_prompts", asked=cfg.run.eval_prompts, prompts=len(self.prompts),
                        held_out=getattr(self.task, "held_out_source", "the task holds out no more"))

    def due(self, step: int) -> bool:
        return bool(self.prompts) and step % self.cfg.run.eval_every == 0

    def evaluate(self, step: int, version: int) -> dict:
        """The version's held-out scores, appended to <run dir>/evals.jsonl; blocking (a thread's)."""
        started = time.perf_counter()
        if self.engine is None:
            self.engine = make_engine(self.cfg)
        self.engine.load_weights(read_shards(weights_at(self.cfg.run_dir, version)))
        reward, correct = held_out_score(self.engine, self.task, self.prompts, self.cfg.sampling.max_new_tokens)
        result = {"step": step, "version": version, "prompts": len(self.prompts), "reward": round(reward, 4),
                  "correct": round(correct, 4), "seconds": round(time.perf_counter() - started, 2)}
        with open(self.cfg.run_dir / "evals.jsonl", "ab") as f:
            f.write(orjson.dumps(result) + b"\n")
        log.info("eval.step", **result)
        return result


def eval_scalars(result: dict) -> dict[str, float]:
    """Under the names `echo-rl eval` logs a trained version's scores."""
    return {"eval/trained_reward": result["reward"], "eval/trained_correct": result["correct"],
            "eval/prompts": float(result["prompts"])}
