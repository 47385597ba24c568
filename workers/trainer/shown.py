"""What a step shows outside the trainer: its line in metrics.jsonl and the log, its sample
completions (samples.jsonl; the log too, with run.log_completions), the warning after steps with
nothing to learn from and its likely cause, and each tracker's scalars. It decides nothing."""

from __future__ import annotations

import asyncio

import orjson
import structlog

from echo.config import EchoConfig
from echo.process.logs import duration
from echo.tasks import Task, answer_format, asks_for_answer
from echo.train.diagnosis import NoSignal, likely_cause
from echo.train.metrics import read_metrics, sampler_scalars, step_scalars
from echo.wire.messages import TrainerStatus
from streams.client import RunClient, retry_forever
from streams.registry import read_statuses
from workers.trainer.accounting import metrics_line
from workers.trainer.evaluation import eval_scalars
from workers.trainer.step import TrainerStep
from workers.trainer.trackers import Trackers

log = structlog.get_logger()


class Shown:
    """Made once the trackers have started; `step` after each step's last phase."""

    def __init__(self, cfg: EchoConfig, run: RunClient, task: Task, trackers: Trackers):
        self.cfg, self.run, self.task, self.trackers = cfg, run, task, trackers
        self.left_out: set[str] = set()  # samplers whose heartbeats gave no scalars (logged once)
        self.no_signal = NoSignal(cfg.trainer.no_signal_steps)
        for record in read_metrics(cfg.run_dir):  # a resumed run's streak goes on
            self.no_signal.observe(record)

    async def step(self, step: TrainerStep, record: dict, status: TrainerStatus, strikes: int,
                   evaluated: dict | None) -> None:
        """The step's finished `record`, with its evaluation where one was due."""
        record = self._write_metrics(record, step, status)
        samples = self._diagnose(step, record)
        if self.trackers.live:
            samplers = await retry_forever("read heartbeats", lambda: read_statuses(self.run))
            scalars = step_scalars(record, strikes) | self._samplers_scalars(samplers, record["version"])
            scalars |= eval_scalars(evaluated) if evaluated else {}
            await asyncio.to_thread(self.trackers.log, step.number, scalars, samples)

    async def evaluated(self, step: int, evaluated: dict) -> None:
        """An evaluation outside a step (run.eval_before: the curve's first point)."""
        if self.trackers.live:
            await asyncio.to_thread(self.trackers.log, step, eval_scalars(evaluated), [])

    def _write_metrics(self, record: dict, step: TrainerStep, status: TrainerStatus) -> dict:
        """The step's line in metrics.jsonl, with its phases' times; returns what it wrote. Logged
        with the run's progress: step 7/20, elapsed and the estimate of the time left."""
        record = {**record, "phase_seconds": {name: round(s, 4) for name, s in step.seconds.items()},
                  "weights": {"bytes": step.published.size, "delta_of": step.published.delta_of}}
        with open(self.cfg.run_dir / "metrics.jsonl", "ab") as f:
            f.write(metrics_line(record))
        log.info("step", step=step.number, progress=f"{step.number}/{status.steps}", version=record["version"],
                 reward=round(record["reward_mean"], 3), used=record["used"], stale=record["dropped_stale"],
                 busy=f"{record['utilisation']:.0%}", seconds=round(record["step_seconds"], 2),
                 elapsed=duration(status.elapsed_s), eta=duration(status.eta_s))
        return record

    def _diagnose(self, step: TrainerStep, record: dict) -> list[dict]:
        """Why the run learns or not (echo/train/diagnosis.py): a warning after steps with nothing to
        learn from, and the step's sample completions, appended to samples.jsonl and returned."""
        if self.no_signal.observe(record):
            task = self.task
            asked = [asks_for_answer(task, task.prompt(a.group.prompt_index).messages) for a in step.collected.used]
            asked_share = None if not asked or None in asked else sum(asked) / len(asked)
            log.warning("run.no_signal", steps=self.no_signal.streak, zero_spread_share=record["zero_spread_share"],
                        cause=likely_cause(record, answer_format(task), self.cfg.sampling.max_new_tokens, asked_share,
                                           getattr(task, "sets_own_format", False)))
        with open(self.cfg.run_dir / "samples.jsonl", "ab") as f:
            f.write(b"".join(orjson.dumps(s) + b"\n" for s in step.samples))
        if self.cfg.run.log_completions:  # decoded from tokens, control characters out (step_samples)
            for s in step.samples:
                log.info("step.completion", step=s["step"], reward=round(s["reward"], 3), sampler=s["sampler"],
                         prompt=s["prompt"][-200:], completion=s["completion"])
        return step.samples

    def _samplers_scalars(self, samplers: list, version: int) -> dict[str, float]:
        scalars, left_out = sampler_scalars(samplers, version)
        for sampler_id in set(left_out) - self.left_out:  # once each: a sampler could send it every beat
            log.warning("trackers.sampler_left_out", sampler=sampler_id, reason="its heartbeat's values")
        self.left_out.update(left_out)
        return scalars
