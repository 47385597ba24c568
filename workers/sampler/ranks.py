"""One MLX sampler's model over several processes of this box (`sampler.ranks`): MLX's ring
backend over loopback, mlx-lm's pipeline giving each rank a share of the layers (echo/engines/mlx.py).

Rank 0 is the sampler process, the only NATS client (one credential, one sampler id, one
heartbeat). It starts the other ranks itself (`start_ranks`), each `python -m
workers.sampler.ranks CONFIG` with MLX_RANK and MLX_HOSTFILE set; they die with it. A rank that
exits is noticed within WATCH_S by `RankWatch`, and the sampler then exits non-zero, saying so:
its supervisor (or `up`'s operator) starts it again, and the trainer hands its slots to the others
once its heartbeat stops. A rank that hangs without exiting is not detected (the collective waits).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog

from echo.config import EchoConfig, load_config
from echo.lifeline import arm_parent_death_signal, die_with_parent

log = structlog.get_logger()

WATCH_S = 0.5  # how often rank 0 looks at the other ranks: a lost rank is noticed within this


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class RankWatch:
    """Rank 0's view of the other ranks' processes: `on_lost` (the rank's number, its exit code)
    is called from a watcher thread once one has exited (by default the sampler exits, saying so)."""

    def __init__(self, processes: list[subprocess.Popen], on_lost=None, every_s: float = WATCH_S):
        self.processes, self.every_s = processes, every_s
        self.on_lost = on_lost or _exit_on_lost
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopped.wait(self.every_s):
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    self.stopped.set()
                    self.on_lost(rank, process.returncode)
                    return

    def close(self, timeout_s: float = 10.0) -> None:
        """The ranks were told to stop: wait for them, then make sure."""
        self.stopped.set()
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()


def _exit_on_lost(rank: int, code: int) -> None:
    log.error("sampler.rank_lost", rank=rank, exit_code=code,
              action="the sampler exits: start it again (its slots go to the other samplers meanwhile)")
    os._exit(3)


def start_ranks(cfg: EchoConfig, on_lost=None):
    """This process as rank 0 of `cfg.sampler.ranks`, the others started here: (the MLX group,
    the RankWatch over the others)."""
    import mlx.core as mx

    folder = Path(tempfile.mkdtemp(prefix="echo-ranks-"))
    hostfile = folder / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in _free_ports(cfg.sampler.ranks)]))
    config = folder / "config.toml"
    config.write_text(cfg.to_toml())
    processes = [subprocess.Popen([sys.executable, "-m", "workers.sampler.ranks", str(config)],
                                  env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                                  preexec_fn=lambda: arm_parent_death_signal(9))
                 for rank in range(1, cfg.sampler.ranks)]
    os.environ.update(MLX_RANK="0", MLX_HOSTFILE=str(hostfile))
    started = time.perf_counter()
    group = mx.distributed.init(strict=True, backend="ring")
    log.info("sampler.ranks", ranks=group.size(), seconds=round(time.perf_counter() - started, 2))
    return group, RankWatch(processes, on_lost)


def main(config_path: str) -> int:
    """A rank other than 0: build its share of the model, then do what rank 0 sends until it stops."""
    import mlx.core as mx

    from echo.engines.mlx import MLXEngine

    die_with_parent()
    cfg = load_config(Path(config_path))
    group = mx.distributed.init(strict=True, backend="ring")
    engine = MLXEngine(cfg.model, cfg.lora, cfg.sampling, group=group)
    engine.follow()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
