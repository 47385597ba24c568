"""The co-located baseline: one process that alternates generating and training on the same
model, what a verl-style co-located run does, built from the same library code as the swarm:
the sampler's engine and group-making (`generate_groups`), the trainer's scorer (its rewards),
and the trainer's TrainerModel (step, micro-batches, optimizer, the weight files it publishes). Same config, task, seed and batch
sizes as a swarm run; every step generates `trainer.groups_per_step` groups with the current
weights (on-policy: staleness 0), then trains on them.

It writes `metrics.jsonl` in the trainer's format (reward, loss, ..., `wait_seconds` is the
generation, `busy_seconds` the training), so `echo-rl report` and the parity bench read it as
they read a swarm's.

    .venv/bin/python -m bench.colocated --config run.toml [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import random
import time

import orjson

from echo.config import EchoConfig, load_config
from echo.engines import make_engine
from echo.engines.base import Engine, call_seed
from echo.tasks import load_task
from echo.train.learner import Batch, Rewarded
from echo.train.metrics import peak_rss_mb
from echo.trust.scorer import Scorer
from echo.weights.files import read_shards
from echo.wire.names import Version
from workers.sampler.generation import generate_groups
from workers.trainer.accounting import metrics_line
from workers.trainer.model import Ranks, TrainerModel


def step_prompts(cfg: EchoConfig, task) -> list[list]:
    """Each step's prompts, drawn from the run's seed (bench/peer_trl.py gives TRL the same)."""
    rng = random.Random(f"{cfg.run.seed}/colocated")
    return [[task.prompt(rng.randrange(2**31)) for _ in range(cfg.trainer.groups_per_step)]
            for _ in range(cfg.run.steps)]


def run_colocated(cfg: EchoConfig, engine: Engine | None = None) -> None:
    """The run `cfg` names, generating with `engine` (default: the one the config makes)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    model = TrainerModel(cfg, Ranks(cfg.model.device))
    engine, task = engine or make_engine(cfg, "colocated"), load_task(cfg.task)
    scorer = Scorer(task, model.tokenizer, model.vocab_size, cfg.sampling)
    started = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "wb") as metrics:
        for step, prompts in enumerate(step_prompts(cfg, task), start=1):
            step_started = time.perf_counter()
            engine.load_weights(read_shards(model.write_weights(step - 1)))  # the current policy, as a sampler gets it
            groups = generate_groups(engine, task, prompts, cfg.sampling, "colocated", Version(0, step - 1),
                                     list(range(1, len(prompts) + 1)), seed=call_seed(cfg.run.seed, "colocated", 0, step))
            batch = Batch([Rewarded(g, scorer.score(g).rewards) for g in groups])
            generated = time.perf_counter()
            stats = model.train(batch).stats
            trained = time.perf_counter()
            metrics.write(metrics_line({
                "step": step, "version": step, **stats,
                "tokens_per_second": stats["tokens"] / stats["train_seconds"],
                "utilisation": (trained - generated) / (trained - step_started),
                "step_seconds": trained - step_started, "wait_seconds": generated - step_started,
                "busy_seconds": trained - generated, "wall_seconds": trained - started,
                "used": len(groups), "dropped_stale": 0, "dropped_tokens": 0, "generated_seconds": generated - step_started,
                "staleness_used": {0: len(groups)}, "rejected": {},
                "groups": [[g.group_id, g.version, g.sampler_id] for g in groups], "peak_rss_mb": peak_rss_mb(),
            }))
            metrics.flush()
    model.write_weights(cfg.run.steps)  # the trained policy, for `echo-rl eval`


def main(run=run_colocated) -> None:
    """`--config` (a swarm run's TOML) and `--set` overrides: the run, then its directory as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", help="TOML config file (the swarm run's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    run(cfg)
    print(orjson.dumps({"run_dir": str(cfg.run_dir)}).decode())


if __name__ == "__main__":
    main()
