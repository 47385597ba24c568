"""`echo-rl up`: a whole swarm on this machine. An embedded nats-server, one trainer and N
samplers, each its own OS process talking only through NATS, exactly as on separate machines.

The trainer and the samplers are forked from this launcher once it has imported what they import
(torch, transformers, peft: 7 s of CPU a process, most of a small swarm's start), as a zygote
does. It must run no torch operation before: GNU OpenMP's thread pool, once started, does not
survive a fork, and a forked worker's first parallel operation would hang (measured). So what
may compute (converting a model) runs in a child of its own (`in_child`)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import orjson
import structlog

from echo.config import ConfigError, EchoConfig
from streams.secure import SERVER_CONF, SecureDir
from streams.server import NatsCluster, NatsServer, ServerConfig, free_port
from workers.operator.relay import loopback_relay_args

log = structlog.get_logger()


def worker_command(args: list[str], ranks: int = 1) -> list[str]:
    """`echo-rl <args>` as a command line; with `ranks` > 1 under torchrun on this machine (a
    trainer on several ranks: torchrun starts them and stops them all when one fails)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    return [sys.executable, *torchrun, "-m", "workers.cli", *args]


# What the trainer's and the samplers' `run` import: imported here once, before they are forked.
WORKER_MODULES = ("workers.trainer.trainer", "workers.trainer.model", "workers.sampler.sampler")


def _spawn(args: list[str], log_json: bool, ranks: int = 1, threads: int = 1,
           fork: bool = False) -> subprocess.Popen | Forked:
    """A worker in its own session (Ctrl-C reaches only this launcher, which then stops the
    children in order): forked with `fork` (WORKER_MODULES imported), else started by exec; with
    `ranks` > 1 under torchrun."""
    args = args + (["--log-json"] if log_json else [])
    env = {"ECHO_PROGRESS": "0"}  # the swarm shares one terminal: no progress lines redrawn in it
    if ranks > 1:
        env["OMP_NUM_THREADS"] = str(threads)  # else torchrun sets 1, loudly
    elif fork:
        return Forked(args, env)
    return subprocess.Popen(worker_command(args, ranks), start_new_session=True, env={**os.environ, **env})


class Forked:
    """A worker forked from this process: what the swarm uses of subprocess.Popen (pid, args,
    returncode, send_signal, kill). The child runs `echo-rl <args>` as a process started for it
    would: its own session, default signal handlers, `env` set, then the command (workers/entry.py:
    the trainer's or a sampler's alone, so the child never imports the command line that imports this)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.args, self.returncode = worker_command(args), None
        self.pid = _fork()
        if self.pid == 0:
            try:
                os.setsid()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.environ.update(env)
                sys.argv = self.args[2:]
                from workers.entry import WORKERS, run

                run(WORKERS, args)  # exits
            except SystemExit as e:  # argparse's
                os._exit(e.code if isinstance(e.code, int) else 1)
            except BaseException:  # anything before its own exit: said, and the child still exits
                traceback.print_exc()
            os._exit(1)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork() -> int:
    sys.stdout.flush()
    sys.stderr.flush()  # else the child writes out what this process had buffered as well
    return os.fork()


def in_child(fn, *args):
    """fn(*args) in a forked child, its result (JSON) or its ConfigError back through a pipe: the
    torch work it may do stays out of a process that forks workers afterwards."""
    read, write = os.pipe()
    pid = _fork()
    if pid == 0:
        try:  # whatever happens, the child goes no further than here
            os.close(read)
            try:
                answer = orjson.dumps({"value": fn(*args)})
            except ConfigError as e:
                answer = orjson.dumps({"config_error": str(e)})
            except BaseException as e:
                answer = orjson.dumps({"error": f"{type(e).__name__}: {e}"})
            with os.fdopen(write, "wb") as pipe:
                pipe.write(answer)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        out = orjson.loads(answer.read() or b"{}")
    os.waitpid(pid, 0)
    if "config_error" in out:
        raise ConfigError(out["config_error"])
    if "value" not in out:
        raise RuntimeError(f"{fn.__name__}{args}: {out.get('error', 'the child died without an answer')}")
    return out["value"]


def reap(p: subprocess.Popen, peaks: dict[int, float], block: bool = False) -> int | None:
    """Popen.poll (or wait, with `block`) that also keeps the process's peak resident MB, which
    only wait4 gives and only once: Popen takes the exit code set here instead of waiting again."""
    if p.returncode is None:
        pid, status, usage = os.wait4(p.pid, 0 if block else os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            peaks[p.pid] = usage.ru_maxrss / 1024  # KiB on Linux
    return p.returncode


def stop_processes(processes: list[subprocess.Popen], timeout: float = 20.0,
                   peaks: dict[int, float] | None = None) -> None:
    """SIGTERM to each that runs, then wait for all; one that outlasts `timeout` is killed.
    With `peaks`, each process's peak resident MB is kept in it by pid."""
    peaks = {} if peaks is None else peaks
    for p in processes:
        if reap(p, peaks) is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        while reap(p, peaks) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.returncode is None:  # e.g. a trainer in the middle of a long step
            log.warning("swarm.kill", pid=p.pid, args=p.args[3:5])
            p.kill()
            reap(p, peaks, block=True)


SITE = "site"  # the relay of `up --relay`


def allow_own_precision(cfg: EchoConfig) -> bool:
    """A swarm's samplers are its operator's own: the precision model.dtype asks of them is added
    to sampling.dtypes (a trainer facing others' samplers keeps that list as it is set). Whether
    it was added."""
    if cfg.model.dtype in ("bfloat16", "float16") and cfg.model.dtype not in cfg.sampling.dtypes:
        cfg.sampling.dtypes = [*cfg.sampling.dtypes, cfg.model.dtype]
        return True
    return False


def secure_swarm(cfg: EchoConfig, relay: bool) -> SecureDir:
    """Credentials for this run's trainer, samplers and relay in <run>/secure (kept across a resume)."""
    secure = SecureDir(cfg.run_dir / "secure")
    if not secure.ca_file.exists():
        secure.init(cfg.run.id, ["localhost", "127.0.0.1"], [])
    for i in range(1, cfg.sampler.count + 1):
        if not secure.seed_file(f"sampler-s{i}").exists():
            secure.add_sampler(f"s{i}")
    if relay and not secure.relay_files(SITE).seed_file.exists():
        secure.add_relay(SITE, [])
    return secure


def _creds_args(secure: SecureDir | None, user: str) -> list[str]:
    if secure is None:
        return []
    return ["--creds", str(secure.seed_file(user)), "--tls-ca", str(secure.ca_file)]


def up(cfg: EchoConfig, log_json: bool = False, relay: bool = False, secure: bool = False, cluster: int = 0,
       trainer_ranks: int = 1) -> int:
    """With `relay`, the samplers sit behind a site relay (`echo-rl relay`), as on a remote site.
    With `secure`, the broker speaks TLS only and each process has its own role's credentials;
    with both, the relay mirrors weights only, and its samplers reach the hub for the rest.
    With `cluster` N, the broker is N nats-servers in one JetStream cluster, every stream and
    bucket kept on all of them (`nats.replicas`). With `trainer_ranks` N, the trainer is N ranks
    under torchrun, its model sharded across them (workers/trainer/model.py)."""
    if trainer_ranks < 1:
        raise ConfigError(f"--trainer-ranks {trainer_ranks}: at least 1")
    if cluster and not 1 <= cluster <= 5:
        raise ConfigError(f"--cluster {cluster}: 1 to 5 nodes (JetStream keeps at most 5 copies of a stream)")
    if cluster and secure:
        raise ConfigError("--cluster with --secure: a secured cluster is not built yet (docs/security.md)")
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if allow_own_precision(cfg):
        log.info("swarm.dtypes", model_dtype=cfg.model.dtype, sampling_dtypes=cfg.sampling.dtypes)
    from echo.model.loading import TINY, pin_model

    if cfg.model.name not in TINY:  # built by each worker in milliseconds; else converted or fetched once here
        cfg.model.name = in_child(pin_model, cfg.model.name)
    for module in WORKER_MODULES:  # before the server starts: its start overlaps nothing of theirs anyway
        importlib.import_module(module)
    secure_dir = secure_swarm(cfg, relay) if secure else None
    secured = {"include": secure_dir.dir / SERVER_CONF, "leaf_include": secure_dir.leaf_conf} if secure_dir else {}
    leaf_port = free_port() if relay else None
    if cluster:
        server = NatsCluster(run_dir / "nats", cluster, log_dir=run_dir, leaf_port=leaf_port)
        cfg.nats.replicas = cluster
    else:
        server = NatsServer(run_dir / "nats", ServerConfig(log_file=run_dir / "nats.log", leaf_port=leaf_port, **secured))
    server.start()
    cfg.nats.url = server.url
    # Torch threads that outnumber the cores make every process crawl. The samplers share the
    # cores; the trainer may use all of them, as samplers mostly wait while it steps (backpressure).
    cores = os.cpu_count() or 1
    cfg.trainer.threads = cfg.trainer.threads or max(1, cores // trainer_ranks)
    cfg.sampler.threads = cfg.sampler.threads or max(1, cores // cfg.sampler.count)
    cfg.trainer.min_samplers = cfg.trainer.min_samplers or cfg.sampler.count  # every sampler takes part
    config_path = run_dir / "config.toml"
    config_path.write_text(cfg.to_toml())
    log.info("swarm.start", run=cfg.run.id, dir=str(run_dir), nats=server.url, samplers=cfg.sampler.count,
             trainer_ranks=trainer_ranks)

    trainer = _spawn(["trainer", "--config", str(config_path), *_creds_args(secure_dir, "trainer")], log_json,
                     trainer_ranks, cfg.trainer.threads, fork=True)
    relays, server_args = [], ["--nats", server.url]
    if relay:
        port = free_port()
        relays.append(_spawn(loopback_relay_args(server.leaf_url, cfg.run.id, port, run_dir / "relay")
                             + _creds_args(secure_dir, f"relay-{SITE}"), log_json))
        relay_url = f"nats://127.0.0.1:{port}"
        # A secured relay serves weights only: its samplers reach the hub for everything else.
        server_args = ["--nats", server.url, "--weights-from", relay_url] if secure else ["--nats", relay_url]
    samplers = [
        _spawn(["sampler", "--config", str(config_path), "--id", f"s{i}", *server_args,
                *_creds_args(secure_dir, f"sampler-s{i}")], log_json, fork=True)
        for i in range(1, cfg.sampler.count + 1)
    ]
    code, stopped_by, peaks = 1, [signal.SIGINT], {}

    def on_stop(signum, _frame):  # `kill` or `timeout` stops the swarm as Ctrl-C does
        stopped_by.append(signal.Signals(signum))
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control (`up &` in a script, nohup) starts it ignored, and
    # Python then leaves it so: `kill -INT` did nothing, and the run went on.
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    try:
        while (code := reap(trainer, peaks)) is None:
            died = [p for p in samplers if reap(p, peaks) is not None]
            if len(died) == len(samplers):
                log.error("swarm.no_samplers", exit_codes=[p.returncode for p in died])
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        log.info("swarm.interrupted", signal=stopped_by[-1].name)
        code = 128 + stopped_by[-1]
    finally:
        stop_processes([trainer, *samplers], peaks=peaks)
        stop_processes(relays, peaks=peaks)  # after their samplers: a sampler's last heartbeat goes through its relay
        server.stop()
    if code == 0:
        names = {trainer.pid: "trainer", **{p.pid: f"s{i}" for i, p in enumerate(samplers, 1)}}
        peak_rss_mb = {names[pid]: round(mb, 1) for pid, mb in peaks.items() if pid in names}
        try:
            finish(run_dir, cfg.run.eval_prompts, peak_rss_mb)
        except KeyboardInterrupt:  # the run is trained and kept: only its evaluation is cut short
            log.info("swarm.interrupted", signal=stopped_by[-1].name, during="evaluation")
            code = 128 + stopped_by[-1]
    return code


def finish(run_dir: Path, eval_prompts: int, peak_rss_mb: dict[str, float]) -> None:
    """A finished run's summary, report and held-out evaluation, each said where it is written;
    with each process's peak resident MB (a trainer on several ranks: torchrun's largest)."""
    from echo.train.metrics import read_metrics, summarize
    from workers.operator.charts import write_report  # matplotlib: a second, so after the run

    summary = {**summarize(read_metrics(run_dir)), "peak_rss_mb": peak_rss_mb}
    log.info("swarm.done", run_dir=str(run_dir), **summary)
    if eval_prompts:
        from workers.operator.heldout import evaluate_run  # transformers and the engines

        summary["eval"] = evaluate_run(run_dir, eval_prompts)
    summary["report"] = str(write_report(run_dir))  # after the evaluation: the report shows it
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    log.info("swarm.report", report=summary["report"], summary=str(run_dir / "summary.json"))
    if (run_dir / "tensorboard").is_dir():  # run.trackers: how to look at it
        log.info("swarm.tensorboard", command=f"tensorboard --logdir {run_dir / 'tensorboard'}")
