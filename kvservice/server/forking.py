"""Forking the server's process for a snapshot, safely.

The audit of a large pool runs in a forked child (``audit``), which sees the whole
process copy-on-write at one instant. Only the forking thread lives on in a child, so
a lock another thread held at the fork stays held there for good; a child is safe if
it never takes such a lock. Ours runs plain Python over the pool and writes to a
pipe, with two exceptions to rule out:

* gRPC's own fork handlers. Unless ``GRPC_ENABLE_FORK_SUPPORT`` is off when grpc is
  imported, gRPC's core registers ``pthread_atfork`` handlers: at each fork they try
  to stop gRPC's threads (logging "Other threads are currently calling into gRPC,
  skipping fork() handlers" when one is busy) and, when they did, reset gRPC's state
  in the child, which can crash it (SIGSEGV) before any of our code runs.
  ``kvservice serve`` turns them off before anything imports grpc
  (``disable_grpc_fork_handlers``); a process that imported grpc with them on gets no
  forked audit (``grpc_fork_handlers_off`` says which).
* The garbage collector: a collection in the child could finalize a gRPC object and
  call into gRPC's core. ``fork`` turns the collector off across the fork and leaves
  it off in the child.

``prepare_child`` then gives the child the default signal dispositions (a SIGTERM
ends it) and closes every descriptor it inherited but the one it writes to.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
CAN_FORK = hasattr(os, "fork")
_OFF = {"0", "false"}


def disable_grpc_fork_handlers() -> None:
    """Ask gRPC not to register fork handlers; effective only before grpc is first
    imported (the ``kvservice`` entry point calls it first thing). A value already in
    the environment is kept."""
    if "grpc" not in sys.modules:
        os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "0")


def grpc_fork_handlers_off() -> bool:
    """Whether gRPC was told not to register fork handlers (read from the environment,
    which is what gRPC read when it was imported)."""
    return os.environ.get(GRPC_FORK_SUPPORT_ENV, "").strip().lower() in _OFF


def unsafe_reason() -> str | None:
    """Why this process may not fork a snapshot, or None when it may."""
    if not CAN_FORK:
        return "this platform has no fork()"
    if not grpc_fork_handlers_off():
        return (
            f"gRPC was imported with its fork handlers on, which can crash a forked "
            f"child: set {GRPC_FORK_SUPPORT_ENV}=0 in the environment before grpc is "
            f"imported (kvservice serve does)"
        )
    return None


def fork() -> int:
    """``os.fork()`` with the garbage collector off across it: back on in the parent
    (if it was), off for good in the child."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        pid = os.fork()
    except BaseException:
        if was_enabled:
            gc.enable()
        raise
    if pid and was_enabled:
        gc.enable()
    return pid


def prepare_child(keep_fd: int) -> None:
    """In a forked child: default signal handling, and every inherited descriptor
    closed but ``keep_fd`` and the standard streams (the parent's sockets stay the
    parent's: closing the child's copies ends nothing)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, os.sysconf("SC_OPEN_MAX"))
