"""Every log line says who wrote it: run, role, worker and the policy version it runs."""

import subprocess
import sys
import threading
from pathlib import Path

import orjson
import structlog

from echo.process.logs import bind_process, configure_logging

ECHO_RL = str(Path(sys.executable).parent / "echo-rl")


def test_json_lines_carry_the_processs_identity_from_any_thread(capsys):
    configure_logging(json=True, run="r1", role="sampler", worker="sampler-s1")
    structlog.get_logger().info("sampler.ready")
    bind_process(version=3)  # after a thread was started, as when the engine applies new weights
    thread = threading.Thread(target=lambda: structlog.get_logger().info("weights.applied"))
    thread.start()
    thread.join()
    structlog.get_logger().info("step", version=9)  # a line's own field wins
    lines = [orjson.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["run"], line["role"], line["worker"], line.get("version")) for line in lines] == [
        ("r1", "sampler", "sampler-s1", None), ("r1", "sampler", "sampler-s1", 3), ("r1", "sampler", "sampler-s1", 9)]


def test_a_terminal_line_leads_with_the_worker_and_version(capsys):
    configure_logging(run="r1", role="trainer", worker="trainer")
    bind_process(version=4)
    structlog.get_logger().info("trainer.ready", steps=20)
    line = capsys.readouterr().err
    assert "[trainer v4] trainer.ready" in line and "steps=20" in line and "run=" not in line


def test_progress_is_drawn_on_a_terminal_never_across_a_log_line_and_not_in_json(capsys):
    from echo.process.logs import Progress

    configure_logging(run="r1", role="eval", worker="eval", progress=True)
    with Progress("held-out", 4, " prompts") as progress:
        progress.advance(2)
        structlog.get_logger().info("eval.note")
        progress.advance(2)
    err = capsys.readouterr().err
    assert "\rheld-out: 2/4 prompts (50%)\n" in err  # the log line starts on a line of its own
    assert err.endswith("\rheld-out: 4/4 prompts (100%)\n")
    configure_logging(json=True)
    with Progress("held-out", 4, " prompts") as progress:
        progress.advance(4)
    assert capsys.readouterr().err == ""


def test_a_tls_peer_closing_prints_no_asyncio_noise(secured):
    """Every TLS client printed `returning true from eof_received() has no effect when using ssl`
    (asyncio's own warning, no prefix) when its server closed."""
    server, secure = secured
    observer = secure.credentials("observer")
    done = subprocess.run([ECHO_RL, "status", "--nats", server.url, "--run-id", "sec", "--creds",
                           str(observer.seed_file), "--tls-ca", str(observer.ca_file), "--once"],
                          capture_output=True, text=True, timeout=120)
    assert "eof_received" not in done.stderr, done.stderr


def test_a_module_logger_used_before_a_commands_set_up_follows_it(capsys):
    """A command's level="error" did not hold for a module's logger used before it (structlog
    caches a logger's configuration on first use): `status` printed the connection's warnings
    above its one line when an earlier test had connected at the info level."""
    from streams.client import log

    configure_logging(level="info")
    log.warning("early")
    configure_logging(level="error")  # a command whose output is its answer
    log.warning("said only at the info level")
    assert capsys.readouterr().err.count("\n") == 1
