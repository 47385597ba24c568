"""The experiment trackers the trainer (rank 0) writes to (`run.trackers`): TensorBoard, W&B
and MLflow, each an optional extra. Every step's scalars (echo/train/metrics.py), the config at the
start, each step's sample completions (a table or text), the run's summary at the end. A resumed trainer continues the same tracker run: W&B's run
id is echo-rl's, MLflow's run is found by its `echo.run_id` tag, TensorBoard appends to the
run directory's event files. A tracker that fails (not installed, no network, a full disk) is
logged once and dropped; training goes on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import structlog

from echo.config import ConfigError, EchoConfig

log = structlog.get_logger()


class Tracker:
    """The contract: `start` once with the run's config, `log` a step's scalars and sample
    completions (workers/trainer/accounting.py's step_samples), `finish` with
    the run's summary (not called when the trainer stops early), `close` always. Any may raise:
    Trackers drops a tracker that does."""

    name = ""

    def start(self, cfg: EchoConfig) -> None: ...

    def log(self, step: int, scalars: dict[str, float], samples: list[dict]) -> None: ...

    def finish(self, summary: dict) -> None: ...

    def close(self) -> None: ...


class TensorBoard(Tracker):
    name = "tensorboard"

    def start(self, cfg: EchoConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(cfg.run_dir / "tensorboard"))
        self.writer.add_text("config", f"```\n{cfg.to_toml()}\n```")

    def log(self, step: int, scalars: dict[str, float], samples: list[dict]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if samples:
            self.writer.add_text("samples", "\n\n".join(_markdown(s) for s in samples), step)
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        self.writer.add_text("summary", "\n".join(f"- {k}: {v}" for k, v in summary.items()))

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    name = "wandb"

    def start(self, cfg: EchoConfig) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=cfg.run.project, id=cfg.run.id, name=cfg.run.id, resume="allow", mode=mode,
                              dir=str(cfg.run_dir), config=cfg.model_dump(mode="json"))
        log.info("tracker.wandb", mode=mode, dir=str(Path(self.run.dir).parent))

    def log(self, step: int, scalars: dict[str, float], samples: list[dict]) -> None:
        import wandb

        if samples:
            scalars = {**scalars, "samples": wandb.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])}
        self.run.log(scalars, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update({f"run/{k}": v for k, v in summary.items() if isinstance(v, (int, float, str))})

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    name = "mlflow"

    def start(self, cfg: EchoConfig) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI") or mlflow_store(cfg.run_dir))
        experiment = self.client.get_experiment_by_name(cfg.run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.run.project, (cfg.run_dir / "mlflow-artifacts").resolve().as_uri())  # not in the cwd
        found = self.client.search_runs([experiment_id], f"tags.`echo.run_id` = '{cfg.run.id}'")
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.run.id,
                                                 tags={"echo.run_id": cfg.run.id}).info.run_id
            params = _flat(cfg.model_dump(mode="json"))
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def log(self, step: int, scalars: dict[str, float], samples: list[dict]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_name(k), v, now, step) for k, v in scalars.items()])
        if samples:
            self.client.log_dict(self.run_id, samples, f"samples/step-{step:06d}.json")

    def finish(self, summary: dict) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {t.name: t for t in (TensorBoard, WandB, MLflow)}  # each named as the package it needs


def mlflow_store(run_dir: Path) -> str:
    """The run's own MLflow store: SQLite in the run directory (MLflow's file store is retired)."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def _flat(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


def _markdown(sample: dict) -> str:
    """One sample as TensorBoard's text panel shows it: its facts, then prompt and completion in
    code blocks (the text cannot close them: its backticks are spaced out)."""

    def block(text: str) -> str:
        return "```\n" + text.replace("```", "` ` `") + "\n```"

    return (f"**reward {sample['reward']:g}** · sampler {sample['sampler']} · version {sample['version']} · "
            f"{sample['finish_reason']}\n\n{block(sample['prompt'])}\n\n{block(sample['completion'])}")


def _mlflow_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)  # MLflow's allowed characters


def check_trackers(names: list[str]) -> None:
    """Each tracker's package importable, or a one-line error at start naming the extra."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise ConfigError(f"run.trackers {missing}: not installed here: pip install 'echo-rl[trackers]' "
                          f"(or {' '.join(missing)})")


class Trackers:
    """The run's trackers, each dropped at its first failure (logged once, with the reason)."""

    def __init__(self, cfg: EchoConfig):
        self.live: list[Tracker] = []
        for name in cfg.run.trackers:
            tracker = TRACKERS[name]()
            if self._call(tracker, "start", cfg):
                self.live.append(tracker)

    def log(self, step: int, scalars: dict[str, float], samples: list[dict] = ()) -> None:
        self.live = [t for t in self.live if self._call(t, "log", step, scalars, list(samples))]

    def finish(self, summary: dict) -> None:
        self.live = [t for t in self.live if self._call(t, "finish", summary)]

    def close(self) -> None:
        for tracker in self.live:
            self._call(tracker, "close")
        self.live = []

    @staticmethod
    def _call(tracker: Tracker, method: str, *args) -> bool:
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker's failure is its own, never the run's
            log.warning("tracker.failed", tracker=tracker.name, during=method, reason=f"{type(e).__name__}: {e}"[:300],
                        then="no longer written to in this trainer process")
            return False
