"""structlog setup: JSON lines when stdout is not a terminal, console output when it is."""

from __future__ import annotations

import logging
import sys

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info") -> None:
    """Configure structlog for the whole process (call once, from the entry point).

    ``contextvars`` come first, so the fields the RPC interceptor binds (``rpc``,
    ``request_id``) appear on every line an RPC logs.
    """
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[structlog.typing.Processor]
    if sys.stdout.isatty():
        renderer = [structlog.dev.ConsoleRenderer()]
    else:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
