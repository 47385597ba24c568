"""`echo-rl replay --run DIR --retrain`: train again over exactly the groups each recorded step
consumed, in the recorded order, from the run's config and seed, and compare the result with
the weights the run published. On the same machine (CPU, fp32, the run's thread count) the
adapter comes out bit for bit the same: any odd run becomes a case anyone can re-run, step it
through, or change one thing in.

The groups come from the run's rollout stream (kept whole by its limits retention), the order
from `metrics.jsonl` (each step names the groups it trained on), the rewards from the trainer's
own scorer, the initial adapter from the run's seed.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import structlog
from safetensors.torch import load

from echo.config import load_config
from echo.tasks import load_task
from echo.train.learner import Batch, Rewarded
from echo.train.metrics import read_metrics
from echo.trust.scorer import Scorer
from echo.weights.files import latest_weights
from echo.wire.codec import ProtocolError
from echo.wire.messages import RolloutGroup
from streams.credentials import Credentials
from streams.replay import run_broker, stored_groups
from workers.trainer.model import Ranks, TrainerModel

log = structlog.get_logger()


async def _groups(url: str, run_id: str, credentials: Credentials | None) -> dict[str, RolloutGroup]:
    return {group.group_id: group async for _, group in stored_groups(url, run_id, credentials)
            if not isinstance(group, ProtocolError)}


def retrain(run_dir: Path, nats_url: str | None = None, credentials: Credentials | None = None) -> dict:
    """Retrain the run in a temporary directory; what came out, against what the run published."""
    steps = read_metrics(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps")
    version, published = latest_weights(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(run_dir / "config.toml", [f"run.dir={tmp}"])  # a fresh model, not the run's checkpoint
        # The live run, or the run's store.
        with run_broker(cfg.run.id if nats_url else run_dir, nats_url, credentials) as (url, run_id, credentials):
            groups = asyncio.run(_groups(url, run_id, credentials))
        model = TrainerModel(cfg, Ranks(cfg.model.device))
        scorer = Scorer(load_task(cfg.task), model.tokenizer, model.vocab_size, cfg.sampling, model.routing)
        for step in steps:
            missing = [g for g, _, _ in step["groups"] if g not in groups]
            if missing:
                raise ValueError(f"step {step['step']}: groups {missing[:3]} are not in the stream (its retention?)")
            model.train(Batch([Rewarded(groups[g], scorer.score(groups[g]).rewards) for g, _, _ in step["groups"]],
                              step["version"] - 1 - cfg.staleness_bound, step["step"]))  # what the run's step trained
            log.info("retrain.step", step=step["step"], of=steps[-1]["step"], groups=len(step["groups"]))
        retrained = model.write_weights(steps[-1]["version"])
        ours = [f.read_bytes() for f in retrained]
    theirs = [f.read_bytes() for f in published]
    report = {"steps": len(steps), "version": steps[-1]["version"], "published_version": version,
              "identical": version == steps[-1]["version"] and ours == theirs}
    if not report["identical"] and len(ours) == len(theirs):
        diffs = [(a[k].float() - b[k].float()).abs().max().item()
                 for a, b in zip(map(load, ours), map(load, theirs)) for k in a if k in b]
        report["max_abs_diff"] = max(diffs, default=None)
    return report
