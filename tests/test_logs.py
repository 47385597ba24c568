"""Every log line says who wrote it: run, role, worker and the policy version it runs."""

import threading

import orjson
import structlog

from echo.logs import bind_process, configure_logging


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
    from echo.logs import Progress

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
