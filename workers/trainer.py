"""The trainer process: consume rollout groups, take GRPO steps, publish each new adapter.

Step s trains on groups whose policy version is within the staleness bound of version s - 1
and publishes version s. In sequential mode it first asks the samplers for exactly the groups
it needs, generated with its current version.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import structlog

from echo.config import EchoConfig
from echo.learner import make_optimizer, set_threads, train_step
from echo.models import load_model
from echo.policy import add_lora, adapter_bytes
from echo.protocol import ProtocolError, RolloutGroup, decode_rollout
from echo.staleness import Verdict, judge
from streams.client import Run, open_run
from streams.pull import publish_pull_request
from streams.rollouts import fetch_rollouts, trainer_subscription
from streams.weights import publish_weights

log = structlog.get_logger()


@dataclass
class Collected:
    used: list = field(default_factory=list)  # (message, group) pairs, acked after the step
    dropped: Counter = field(default_factory=Counter)  # stale groups by age in versions
    rejected: Counter = field(default_factory=Counter)  # malformed groups by reason


class Collector:
    """Pulls rollout messages until it has enough usable groups, acking the rest at once."""

    def __init__(self, subscription, cfg: EchoConfig):
        self.subscription = subscription
        self.group_size = cfg.sampling.group_size
        self.max_staleness = 0 if cfg.run.mode == "sequential" else cfg.trainer.max_staleness

    async def collect(self, need: int, version: int, on_wait=None) -> Collected:
        out = Collected()
        while len(out.used) < need:
            msgs = await fetch_rollouts(self.subscription, need - len(out.used), timeout=1.0)
            if not msgs and on_wait is not None:
                await on_wait(need - len(out.used))
            for msg in msgs:
                group = self._admit(msg, version, out)
                if group is None:
                    await msg.ack()  # dropped or rejected: it stays in the stream for replay
                else:
                    out.used.append((msg, group))
        return out

    def _admit(self, msg, version: int, out: Collected) -> RolloutGroup | None:
        try:
            group = decode_rollout(msg.data, msg.headers)
        except ProtocolError as e:
            return _reject(out, e.reason, str(e))
        if len(group.completions) != self.group_size:
            return _reject(out, "wrong_group_size", f"{len(group.completions)} != {self.group_size}")
        verdict = judge(group.policy_version, version, self.max_staleness)
        if verdict is Verdict.FUTURE:
            return _reject(out, "future_version", f"{group.policy_version} > {version}")
        if verdict is Verdict.STALE:
            out.dropped[version - group.policy_version] += 1
            return None
        return group


def _reject(out: Collected, reason: str, detail: str) -> None:
    out.rejected[reason] += 1
    log.warning("rollout.rejected", reason=reason, detail=detail)
    return None


class SequentialRequests:
    """Sequential mode: ask for the groups of a step, and ask again for what has not arrived
    by the timeout (a sampler may have died holding a claim)."""

    def __init__(self, run: Run, timeout_s: float):
        self.run, self.timeout_s = run, timeout_s
        self.asked_at = 0.0
        self.version = -1

    async def ask(self, version: int, groups: int) -> None:
        self.version, self.asked_at = version, time.monotonic()
        await publish_pull_request(self.run, version, groups)

    async def on_wait(self, missing: int) -> None:
        if time.monotonic() - self.asked_at > self.timeout_s:
            log.warning("pull.reissue", version=self.version, missing=missing)
            await self.ask(self.version, missing)


async def run_trainer(cfg: EchoConfig) -> None:
    set_threads(cfg.trainer.threads)
    run_dir = cfg.run_dir
    (run_dir / "adapters").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    run = await open_run(cfg.nats.url, cfg.run.id, "trainer")
    await run.state.put("config", cfg.model_dump_json().encode())

    base, tokenizer = load_model(cfg.model.name)
    policy = add_lora(base, cfg.lora)
    optimizer = make_optimizer(policy, cfg)
    subscription = await trainer_subscription(run)
    collector = Collector(subscription, cfg)
    requests = SequentialRequests(run, cfg.trainer.request_timeout_s) if cfg.run.mode == "sequential" else None

    version = 0
    await publish_adapter(run, cfg, policy, version, run_dir)
    log.info("trainer.ready", run=cfg.run.id, mode=cfg.run.mode, model=cfg.model.name, steps=cfg.run.steps)
    started = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "ab") as metrics_file:
        for step in range(1, cfg.run.steps + 1):
            step_started = time.perf_counter()
            if requests:
                await requests.ask(version, cfg.trainer.groups_per_step)
            collected = await collector.collect(
                cfg.trainer.groups_per_step, version, requests.on_wait if requests else None
            )
            groups = [group for _, group in collected.used]
            stats = await asyncio.to_thread(train_step, policy, optimizer, groups, cfg, tokenizer.pad_token_id)
            version += 1
            publish_seconds = await publish_adapter(run, cfg, policy, version, run_dir)
            for msg, _ in collected.used:  # acked only once the step that used them is done
                await msg.ack()

            now = time.perf_counter()
            record = {
                "step": step,
                "version": version,
                **stats,
                "used": len(groups),
                "dropped_stale": sum(collected.dropped.values()),
                "rejected": dict(collected.rejected),
                "staleness_used": dict(Counter(version - 1 - g.policy_version for g in groups)),
                "staleness_dropped": dict(collected.dropped),
                "learner_busy": stats["train_seconds"] / (now - step_started),
                "step_seconds": now - step_started,
                "publish_seconds": publish_seconds,
                "wall_seconds": now - started,
                "groups": [[g.group_id, g.policy_version, g.sampler_id] for g in groups],
            }
            metrics_file.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n")
            metrics_file.flush()
            log.info(
                "step",
                step=step,
                version=version,
                reward=round(stats["reward_mean"], 3),
                used=len(groups),
                stale=record["dropped_stale"],
                busy=f"{record['learner_busy']:.0%}",
                seconds=round(record["step_seconds"], 2),
            )
    await run.close()


async def publish_adapter(run: Run, cfg: EchoConfig, policy, version: int, run_dir: Path) -> float:
    started = time.perf_counter()
    data = adapter_bytes(policy)
    (run_dir / "adapters" / f"v{version:06d}.safetensors").write_bytes(data)
    await publish_weights(run, version, data, cfg.model.name)
    return time.perf_counter() - started
