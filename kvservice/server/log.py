"""structlog setup: JSON lines when stdout is not a terminal, console output when it is."""

from __future__ import annotations

import logging
import sys

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")
# How much of a caller-supplied string (a request id, a client id, an error message
# quoting one) a log line keeps: a caller must not be able to write megabytes of log
# per call.
LOG_VALUE_CHARS = 256


def clip(value: str, limit: int = LOG_VALUE_CHARS) -> str:
    """``value`` cut to ``limit`` characters, saying how long it was."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}...({len(value)} chars)"


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


def unfiltered_logger() -> structlog.typing.FilteringBoundLogger:
    """A logger that writes whatever ``--log-level`` says, for the few lines an
    operator needs at any level (the startup line: the only way to learn a port bound
    as 0)."""
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        None, wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET)
    )
    return logger
