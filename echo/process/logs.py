"""structlog set-up: readable lines on a terminal, one JSON object per line with --log-json;
and a progress line for long operations, on a terminal only."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import structlog


class _CurrentStderr:
    """sys.stderr as it is when a line is written, not when logging was configured (a test's
    captured stream is closed after it; a worker's is the same throughout)."""

    def write(self, text: str) -> int:
        Progress.end_line()  # a log line never lands on the end of a progress line
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


# Who writes this process's lines: run, role, worker and the policy version it runs (trainer:
# the version it last published; sampler: the one its engine runs). A module-level dict, not a
# contextvar: one worker per process, and its threads and tasks started earlier see changes too.
_process: dict = {}
IDENTITY = ("run", "role", "worker", "version")


def bind_process(**fields) -> None:
    """Fields every later log line of this process carries."""
    _process.update(fields)


def _add_identity(logger, method, event_dict: dict) -> dict:
    for key, value in _process.items():
        event_dict.setdefault(key, value)
    return event_dict


def _identity_prefix(logger, method, event_dict: dict) -> dict:
    """On a terminal the identity leads the line, short: `[sampler-s1 v3] event key=value`."""
    fields = {key: event_dict.pop(key, None) for key in IDENTITY}
    parts = [fields["worker"] or fields["role"]]
    if fields["version"] is not None:
        parts.append(f"v{fields['version']}")
    head = " ".join(str(p) for p in parts if p)
    if head:
        event_dict["event"] = f"[{head}] {event_dict['event']}"
    return event_dict


def duration(seconds: float) -> str:
    """Seconds as a person reads a run's progress: 41s, 3m10s, 2h05m."""
    seconds = round(max(seconds, 0.0))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """`label: done/total unit (pct)`, rewritten in place on a terminal as work advances; nothing
    in JSON mode, to a pipe, or in a worker of `echo-rl up` (ECHO_PROGRESS=0: the swarm's
    processes share one terminal). Callers advance it in coarse steps (a batch, a shard)."""

    enabled = False  # configure_logging decides
    _open = False  # a progress line is on the terminal without its newline

    def __init__(self, label: str, total: float, unit: str = "", show: bool = True):
        self.label, self.total, self.unit, self.done, self.show = label, total, unit, 0.0, show
        self._draw()

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        self._draw()

    def _draw(self) -> None:
        if not (Progress.enabled and self.show):
            return
        share = self.done / self.total if self.total else 1.0
        sys.stderr.write(f"\r{self.label}: {self.done:g}/{self.total:g}{self.unit} ({share:.0%})")
        Progress._open = True
        if self.done >= self.total:
            Progress.end_line()
        sys.stderr.flush()

    @staticmethod
    def end_line() -> None:
        if Progress._open:
            Progress._open = False
            sys.stderr.write("\n")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        Progress.end_line()


def _not_tls_eof_noise(record: logging.LogRecord) -> bool:
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def configure_logging(json: bool = False, level: str = "info", progress: bool | None = None, **identity) -> None:
    """`identity`: run, role, worker (and version), on every line; bind_process changes them.
    `progress`: draw progress lines (None: on a terminal, unless JSON or ECHO_PROGRESS=0)."""
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=0)
    )
    _process.clear()
    _process.update({k: v for k, v in identity.items() if v is not None})
    structlog.configure(
        processors=[
            _add_identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S" if not json else "iso"),
            # A JSON line carries the traceback as text (the console renderer prints its own).
            *([structlog.processors.format_exc_info] if json else [_identity_prefix]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),
        # Not cached: a module's logger used before this call (a library, a test before it) would
        # keep the old configuration for good, and a command's level="error" would not hold.
        cache_logger_on_first_use=False,
    )
    # asyncio warns of its own protocol mismatch whenever a TLS peer closes (nats-py's reader
    # returns True from eof_received): a line with no prefix and nothing for the user to do.
    logging.getLogger("asyncio").addFilter(_not_tls_eof_noise)
    # peft calls a transformers API that warns of its own deprecation on every model wrap.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if progress is None:
        progress = not json and sys.stderr.isatty() and os.environ.get("ECHO_PROGRESS") != "0"
    Progress.enabled = progress
    # transformers' progress bars (loading, converting SmolLM2's GGUF) follow the same rule.
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar() if progress else hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
