"""structlog set-up: readable lines on a terminal, one JSON object per line with --log-json."""

from __future__ import annotations

import logging
import sys
import warnings

import structlog


class _CurrentStderr:
    """sys.stderr as it is when a line is written, not when logging was configured (a test's
    captured stream is closed after it; a worker's is the same throughout)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json: bool = False, level: str = "info", **bind) -> None:
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=0)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S" if not json else "iso"),
            # A JSON line carries the traceback as text (the console renderer prints its own).
            *([structlog.processors.format_exc_info] if json else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(**bind)
    # peft calls a transformers API that warns of its own deprecation on every model wrap.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # transformers' download/conversion progress bars would drown the step lines.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
