"""structlog setup: JSON lines when stdout is not a terminal, console output when it is."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


# What ``LineBudget`` lets through: this many lines of one kind per interval, then one
# line saying how many more there were.
LINES_PER_INTERVAL = 10
LINE_INTERVAL_S = 10.0
SUPPRESSED_EVENT = "similar lines suppressed"


@dataclass(slots=True)
class _Window:
    start: float
    written: int = 0
    suppressed: int = 0


class LineBudget:
    """Info lines a client can make the server write (a refused call, a session opened
    or ended, a stream opened or closed), kept to a bounded rate: of each kind (an
    event, and a key from a small fixed set: a status, a reason, a tenant), the first
    ``burst`` in an interval of ``interval_s`` are written, the rest counted, and once
    the interval is over one line says how many were suppressed (``similar lines
    suppressed``, with ``of``: the event, ``key``, ``num_suppressed`` and
    ``interval_s``). The counts an operator watches are in the metrics
    (``kvservice_refusals_total``, ``kvservice_sessions_opened_total``...), which are
    never sampled. One per server (not per process), so two servers do not share a
    budget. On the loop: not thread safe."""

    def __init__(
        self,
        burst: int | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The module's figures when not given (read now, so a test may change them).
        self.burst = LINES_PER_INTERVAL if burst is None else burst
        self.interval_s = LINE_INTERVAL_S if interval_s is None else interval_s
        self._clock = clock
        self._windows: dict[tuple[str, str], _Window] = {}
        self.num_suppressed = 0

    def info(self, logger: Any, event: str, key: str = "", **fields: Any) -> None:
        """``logger.info(event, **fields)`` if the kind ``(event, key)`` has budget
        left in this interval, else count it."""
        kind = (event, key)
        now = self._clock()
        window = self._windows.get(kind)
        if window is None or now - window.start >= self.interval_s:
            if window is not None:
                self._flush(kind, window, logger)
            window = self._windows[kind] = _Window(now)
        if window.written < self.burst:
            window.written += 1
            logger.info(event, **fields)
            return
        if not window.suppressed:
            self._flush_later(kind, window, logger)
        window.suppressed += 1
        self.num_suppressed += 1

    def _flush(self, kind: tuple[str, str], window: _Window, logger: Any) -> None:
        """Say what ``window`` suppressed (once) and forget it."""
        if self._windows.get(kind) is window:
            del self._windows[kind]
        if window.suppressed:
            suppressed, window.suppressed = window.suppressed, 0
            logger.info(
                SUPPRESSED_EVENT,
                of=kind[0],
                key=kind[1] or "-",
                num_suppressed=suppressed,
                interval_s=self.interval_s,
            )

    def _flush_later(self, kind: tuple[str, str], window: _Window, logger: Any) -> None:
        """Say it when the interval ends even if no line of the kind comes after it
        (without a running loop: when the next one comes)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = max(0.0, window.start + self.interval_s - self._clock())
        loop.call_later(delay, self._flush, kind, window, logger)
