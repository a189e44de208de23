"""The one launcher of a ``kvservice serve`` child process on free loopback ports, for
``kvservice bench``, ``kvservice demo`` and the scripts in ``benchmarks/``: a
separate process, so the server does not share the client's GIL."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvservice.client import KVClient, ServiceUnavailableError, UnauthenticatedError

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_POLL_S = 0.05


class ServerStartError(RuntimeError):
    """The server process exited or did not answer in time; carries its output."""


@dataclass(frozen=True, slots=True)
class ChildServer:
    """Where a server listens (and its process, when this one started it)."""

    target: str
    metrics_url: str | None
    pid: int | None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_ready(process: subprocess.Popen[bytes], target: str, log_path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with KVClient(target, timeout=1.0) as client:
        while True:
            if process.poll() is not None:
                raise ServerStartError(
                    f"the server exited with {process.returncode}:\n{_tail(log_path)}"
                )
            try:
                client.get_cache_config()
                return
            except UnauthenticatedError:
                return  # a server with a tokens file answered: it is up
            except ServiceUnavailableError:
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"no answer from {target} in {READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}"
                    ) from None
                time.sleep(_POLL_S)


def _tail(path: str, num_lines: int = 20) -> str:
    with open(path, encoding="utf-8", errors="replace") as log:
        return "".join(log.readlines()[-num_lines:])


@contextlib.contextmanager
def child_server(args: Sequence[str], *, metrics: bool = False) -> Iterator[ChildServer]:
    """Run ``kvservice serve <args>`` on free loopback ports until the block ends, then
    stop it with SIGTERM (its graceful shutdown) and wait for it."""
    port = free_port()
    metrics_port = free_port() if metrics else None
    command = [
        sys.executable,
        "-m",
        "kvservice.cli",
        "serve",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--metrics-port={metrics_port}" if metrics_port is not None else "--no-metrics",
        "--log-level=warning",
        *args,
    ]
    target = f"127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("wb", prefix="kvservice-", suffix=".log") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        try:
            _wait_ready(process, target, log.name)
            url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics else None
            yield ChildServer(target, url, process.pid)
        finally:
            _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
