"""Which asyncio event loop ``kvservice serve`` runs on.

uvloop (an optional dependency: ``pip install 'kvservice[uvloop]'``) takes a good part
of grpc.aio's own per-call cost off the loop: on loopback, a unary call's server CPU
drops by about a fifth (see ``benchmarks/bench_grpc.py``). It is the default when it
is installed; ``--event-loop asyncio`` keeps the standard library's loop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import Callable

EVENT_LOOPS = ("uvloop", "asyncio")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def default_event_loop() -> str:
    """uvloop when it is installed, else asyncio."""
    return "uvloop" if uvloop_installed() else "asyncio"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for ``asyncio.Runner`` (None: the standard loop). Raises
    ``ValueError`` for uvloop when it is not installed."""
    if name == "asyncio":
        return None
    if name != "uvloop":
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {name!r}")
    if not uvloop_installed():
        raise ValueError(
            "event_loop uvloop: uvloop is not installed (pip install 'kvservice[uvloop]')"
        )
    factory: Callable[[], asyncio.AbstractEventLoop] = importlib.import_module(
        "uvloop"
    ).new_event_loop
    return factory
