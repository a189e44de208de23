"""The server's background tasks (the session reaper, the pool's self-check, the loop
and collector watches) end the same way: cancelled, then awaited until they have."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
