"""structlog set up once per process: JSON lines in production, a readable console in a terminal.

Request-scoped values (request_id, route) are bound with `structlog.contextvars.bind_contextvars` and appear on
every line logged while handling that request.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "json", "console"]


class _CurrentStderr:
    """Whatever `sys.stderr` is at each write, so logging never writes to a stream that was swapped out and
    closed after `configure_logging` ran (a test harness's capture, a redirect)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, fmt: LogFormat | None = None) -> None:
    """Configure structlog and the standard library's root logger. Safe to call more than once.

    `level` defaults to $LADLE_LOG_LEVEL or INFO; `fmt` to $LADLE_LOG_FORMAT or "auto" (console when stderr is
    a terminal, JSON otherwise).
    """
    level_name = (level or os.environ.get("LADLE_LOG_LEVEL") or "INFO").upper()
    chosen = fmt or os.environ.get("LADLE_LOG_FORMAT") or "auto"
    use_json = chosen == "json" or (chosen == "auto" and not sys.stderr.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard library (uvicorn, grpc) go through the same renderer.
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_name)
