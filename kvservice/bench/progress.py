"""A progress bar on stderr, small enough not to need a dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    """Counts work units towards ``total`` and redraws one stderr line when the
    percentage changes (on a terminal; elsewhere a line every 10%, so logs stay short).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = self._stream.isatty()
        self._shown = -1
        self._start = time.monotonic()

    def advance(self, label: str, amount: int = 1) -> None:
        self.done += amount
        self.label = label
        percent = min(100 * self.done // self.total, 100)
        step = 1 if self._tty else 10
        if self._enabled and percent // step != self._shown // step:
            self._shown = percent
            self._draw(percent)

    def _draw(self, percent: int) -> None:
        filled = _WIDTH * percent // 100
        elapsed = time.monotonic() - self._start
        eta = elapsed * (self.total - self.done) / self.done if self.done else 0.0
        bar = "#" * filled + "-" * (_WIDTH - filled)
        line = f"[{bar}] {percent:3d}% {self.label:<24} eta {eta:5.1f}s"
        self._stream.write(("\r" + line) if self._tty else (line + "\n"))
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line (on a terminal)."""
        if self._enabled and self._tty and self._shown >= 0:
            self._stream.write("\n")
            self._stream.flush()
