"""One MLX sampler's model over several processes (`sampler.ranks`): MLX's ring backend, mlx-lm's
pipeline giving each rank a share of the layers (echo/engines/mlx.py).

Rank 0 is the sampler process, the only NATS client (one credential, one sampler id, one
heartbeat). On one box it starts the other ranks itself (`start_ranks`), each `python -m
workers.sampler.ranks CONFIG RANK` with a hostfile of free loopback ports; they die with it. On
several boxes (`sampler.hostfile`) each other box runs `echo-rl rank --config FILE --rank N`.

A lost rank: one that exits, or a wait on the others longer than `sampler.rank_timeout_s` (a
hung one: MLX's collectives have no timeout), is noticed by rank 0's `RankWatch` within
WATCH_S of either; between calls rank 0 pings the others every PING_S, so a hung rank is
noticed within rank_timeout_s + PING_S + WATCH_S whatever the sampler is doing. The sampler
then starts again as a new process (exec: an MLX group cannot be rebuilt in a process), with new
ranks, at most MAX_RESTARTS times; meanwhile its heartbeat stops and the trainer hands its slots
to the others. The new process's heartbeat says how many times and why the last time
(`group_restarts`: SamplerStatus.ranks_restarted, rank_lost). A rank of another box, its group
lost, starts again the same way and waits for rank 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog

from echo.config import ConfigError, EchoConfig
from echo.process.lifeline import arm_parent_death_signal, die_with_parent
from echo.wire.names import CONTROL_CHARACTERS
from streams.server import free_port

log = structlog.get_logger()

NAME = "rank"
WATCH_S = 0.5  # how often rank 0 looks at the other ranks
PING_S = 5.0  # between calls, rank 0 pings the others this often: a rank hung while idle is noticed too
MAX_RESTARTS = 5  # a sampler whose ranks keep failing stops, saying so, rather than loop for ever
RESTARTS = "ECHO_RANK_RESTARTS"  # how many times this process's ancestors started again
LOST = "ECHO_RANK_LOST"  # why the last time


def register(sub) -> None:
    from workers.arguments import config_args

    rank = sub.add_parser("rank", help="one rank of an MLX sampler split over several machines (sampler.hostfile): "
                          "run on each box but rank 0's, which is the sampler")
    config_args(rank, run_options=False)
    rank.add_argument("--rank", type=int, required=True, help="this box's rank in sampler.hostfile (1 or more)")


def run(args) -> int:
    from echo.process.logs import configure_logging
    from workers.arguments import config_from_args

    configure_logging(args.log_json, role="rank", worker=f"rank-{args.rank}")
    cfg = config_from_args(args)
    hosts = read_hostfile(cfg)
    if not 1 <= args.rank < len(hosts):
        raise ConfigError(f"--rank {args.rank}: sampler.hostfile names ranks 0 to {len(hosts) - 1}, and 0 is the "
                          "sampler's")
    os.environ.update(MLX_RANK=str(args.rank), MLX_HOSTFILE=cfg.sampler.hostfile)
    return follow(cfg, again=True)


def read_hostfile(cfg: EchoConfig) -> list:
    """sampler.hostfile's ranks, checked against sampler.ranks."""
    try:
        hosts = json.loads(Path(cfg.sampler.hostfile).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"sampler.hostfile {cfg.sampler.hostfile!r}: {e}") from None
    if not isinstance(hosts, list) or len(hosts) != cfg.sampler.ranks:
        raise ConfigError(f"sampler.hostfile {cfg.sampler.hostfile!r}: one [\"host:port\"] a rank, "
                          f"{cfg.sampler.ranks} of them (sampler.ranks)")
    return hosts


class RankWatch:
    """Rank 0's watch over the other ranks: the first that exits, or a wait on them (the engine's
    `waiting_since`, once `engine` is set) past `timeout_s`, calls `on_lost(why)` once, from a
    watcher thread (by default: `start_again`). `lost(why)` says so from elsewhere (a collective
    that failed)."""

    def __init__(self, processes: list[subprocess.Popen], timeout_s: float, on_lost=None, every_s: float = WATCH_S):
        self.processes, self.timeout_s, self.every_s = processes, timeout_s, every_s
        self.on_lost = on_lost or self.start_again
        self.engine = None
        self.stopped, self._once = threading.Event(), threading.Lock()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()
        threading.Thread(target=self._ping, name="rank-ping", daemon=True).start()

    def _ping(self) -> None:  # its own thread: a ping to a hung rank blocks, and the watch sees that wait
        while not self.stopped.wait(PING_S):
            try:
                if self.engine is not None:
                    self.engine.ping()
            except RuntimeError as e:  # "[ring] connection to a peer was lost"
                self.lost(f"a collective failed: {e}")
                return

    def _watch(self) -> None:
        while not self.stopped.wait(self.every_s):
            why = self.trouble(time.monotonic())
            if why is not None:
                self.lost(why)
                return

    def trouble(self, now: float) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return f"rank {rank} exited with code {process.returncode}"
        since = getattr(self.engine, "waiting_since", None)
        if since is not None and now - since > self.timeout_s:
            return f"no answer from the other ranks in {now - since:.0f} s (sampler.rank_timeout_s)"
        return None

    def lost(self, why: str) -> None:
        if self._once.acquire(blocking=False):
            self.stopped.set()
            self.on_lost(why)

    def close(self, timeout_s: float = 10.0) -> None:
        """The ranks were told to stop: wait for them, then make sure."""
        self.stopped.set()
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()

    def start_again(self, why: str) -> None:
        """This sampler as a new process with new ranks (its own command line again), the old
        ranks killed first; after MAX_RESTARTS, it exits, saying so."""
        for process in self.processes:
            process.kill()
        restarts = group_restarts()[0]
        if restarts >= MAX_RESTARTS:
            log.error("sampler.rank_lost", why=why, action=f"the sampler exits: its ranks failed {restarts} times")
            os._exit(3)
        log.warning("sampler.rank_lost", why=why, action=f"the sampler starts again ({restarts + 1} of {MAX_RESTARTS})")
        exec_again(restarts + 1, why)


def group_restarts() -> tuple[int, str]:
    """How many times this sampler's group of ranks was lost and the sampler started again (this
    process's ancestors, by exec_again), and why the last time."""
    return int(os.environ.get(RESTARTS, "0")), os.environ.get(LOST, "")


def exec_again(restarts: int, why: str = "") -> None:
    """This process's command (`echo-rl ...`, however it was started) in place of this process:
    the same pid, session and environment, with `restarts` and `why` (as a heartbeat label: no
    control character, 256 at most), no descriptor but the standard three."""
    os.environ[RESTARTS] = str(restarts)
    os.environ[LOST] = re.sub(f"[{CONTROL_CHARACTERS}]", " ", why)[:256]
    sys.stdout.flush()
    sys.stderr.flush()
    os.closerange(3, 1 << 16)  # the ring's sockets among them: a port of the hostfile is free again
    os.execv(sys.executable, [sys.executable, "-m", "workers.cli", *sys.argv[1:]])


def start_ranks(cfg: EchoConfig, on_lost=None):
    """This process as rank 0 of `cfg.sampler.ranks`: (the MLX group, the RankWatch over the
    others). On one box, the others are started here; with sampler.hostfile, on their boxes."""
    import mlx.core as mx

    processes = []
    if cfg.sampler.hostfile:
        read_hostfile(cfg)
        hostfile = cfg.sampler.hostfile
    else:
        folder = Path(tempfile.mkdtemp(prefix="echo-ranks-"))
        hostfile = str(folder / "ring.json")
        Path(hostfile).write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(cfg.sampler.ranks)]))
        config = folder / "config.toml"
        config.write_text(cfg.to_toml())
        processes = [subprocess.Popen([sys.executable, "-m", "workers.sampler.ranks", str(config), str(rank)],
                                      env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile},
                                      preexec_fn=lambda: arm_parent_death_signal(9))
                     for rank in range(1, cfg.sampler.ranks)]
    os.environ.update(MLX_RANK="0", MLX_HOSTFILE=hostfile)
    started = time.perf_counter()
    group = mx.distributed.init(strict=True, backend="ring")
    log.info("sampler.ranks", ranks=group.size(), seconds=round(time.perf_counter() - started, 2),
             restarts=group_restarts()[0])
    return group, RankWatch(processes, cfg.sampler.rank_timeout_s, on_lost)


def follow(cfg: EchoConfig, again: bool) -> int:
    """A rank other than 0 (MLX_RANK and MLX_HOSTFILE set): build its share of the model, then do
    what rank 0 sends until it says stop. With `again` (a rank of another box), a lost group
    starts this process again, to wait for rank 0's next."""
    import mlx.core as mx

    from echo.engines.mlx import MLXEngine

    try:
        group = mx.distributed.init(strict=True, backend="ring")  # rank 0 not (yet) there: "Couldn't connect"
        engine = MLXEngine(cfg.model, cfg.lora, cfg.sampling, group=group, memory_gb=cfg.sampler.memory_gb)
        log.info("rank.ready", rank=group.rank(), layers=list(engine.layers),
                 weights_mb=[round(mb, 1) for mb in engine.rank_mb])
        engine.follow()
    except RuntimeError as e:  # "[ring] ...": no rank 0 yet, or it stopped, or it started again
        if not again:
            raise
        log.warning("rank.no_group", why=str(e), action="this rank starts again and waits for rank 0")
        time.sleep(1.0)  # not a busy loop where rank 0 is gone for long
        exec_again(group_restarts()[0] + 1, str(e))
    return 0


if __name__ == "__main__":  # a rank on rank 0's box, started by it
    from echo.config import load_config

    die_with_parent()
    os.environ["MLX_RANK"] = sys.argv[2]
    try:
        sys.exit(follow(load_config(Path(sys.argv[1])), again=False))
    except ConfigError:  # the model as rank 0 builds it: rank 0 says the same, in its one line
        sys.exit(2)
