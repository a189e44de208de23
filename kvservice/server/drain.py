"""Graceful shutdown that never strands a call.

grpc.aio's own ``server.stop(grace)`` stops dispatching at once: a call the C core
had already accepted but the Python loop had not yet handed to a handler is never run
and never answered until the grace period ends (the client sees its deadline expire,
not a refusal). So kvservice drains in two phases instead:

1. ``begin()``: grpc keeps dispatching, and the RPC boundary refuses every call that
   starts from now on with UNAVAILABLE before it touches any state; calls already in
   a handler, and open StepStreams, run on.
2. ``wait_idle(grace)`` returns when the last of those has finished (or the grace
   ends); only then does the server stop grpc, with nothing left to strand.
"""

from __future__ import annotations

import asyncio
import contextlib

SHUTTING_DOWN = "the server is shutting down; nothing was applied, retry on another replica"


class Drain:
    """Counts the calls running in a handler and refuses new ones once draining."""

    def __init__(self) -> None:
        self.draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self._active += 1
        self._idle.clear()

    def exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def begin(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every call that had started finished within ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()
