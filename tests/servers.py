"""How the tests start a kvservice server: one launcher in this process, and one for
``kvservice serve`` as a child process.

- ``running_server(config)``: a ``KVCacheServer`` started on the test's event loop, on
  the free loopback port its config asks for (``port=0``), stopped without grace on
  exit. The fixtures of ``tests/conftest.py`` (``server``, ``channel``, ``stub``,
  ``client``, configured by ``server_config``) run on it; ``raw_stub(server)`` is the
  generated stub on a plaintext channel to it.
- ``server_in_thread(config)``: the same server on an event loop of its own in a
  thread, for blocking clients (a sync call made on the test's loop would block the
  server it waits for) and for Prometheus scraping a synchronous test's server.
- ``kvservice_serve(*flags)``: ``kvservice serve`` as a child process, once it wrote
  its startup line (the process and that line: its output is the test's to read, and
  its signals the test's to send); ``run_kvservice(*args)`` runs a command to its end
  (a startup refused, exit status 2). The benchmarks and the engine tests, which only
  need a server process to talk to, use ``kvservice.bench.server.child_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import KVCacheServer, ServerHandle
from kvservice.server.config import ServerConfig

T = TypeVar("T")
Stub = pb_grpc.KVCacheServiceStub
# Safety nets only: each wait ends as soon as its event happens. A child process may
# take longer to start (it imports everything) than a server in a thread.
THREAD_TIMEOUT_S = 60
TIMEOUT_S = 120


# -- in this process ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_server(config: ServerConfig) -> AsyncIterator[KVCacheServer]:
    """A started server on this test's loop, stopped (no grace) on exit."""
    server = KVCacheServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0)


@contextlib.asynccontextmanager
async def raw_stub(server: KVCacheServer) -> AsyncIterator[Stub]:
    """The generated stub on a plaintext channel to ``server``."""
    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        yield pb_grpc.KVCacheServiceStub(channel)


@dataclasses.dataclass(frozen=True)
class ThreadedServer:
    """A server running on its own loop in another thread."""

    server: KVCacheServer
    loop: asyncio.AbstractEventLoop

    @property
    def handle(self) -> ServerHandle:
        return self.server.handle

    @property
    def target(self) -> str:
        return self.server.handle.target

    @property
    def metrics_url(self) -> str:
        assert self.handle.metrics_url is not None, "a config with metrics_port=None"
        return self.handle.metrics_url

    @property
    def metrics_address(self) -> str:
        return f"{self.handle.host}:{self.handle.metrics_port}"

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop (the request table is not thread safe)."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(THREAD_TIMEOUT_S)


@contextlib.contextmanager
def server_in_thread(config: ServerConfig) -> Iterator[ThreadedServer]:
    """``running_server(config)`` on an event loop of its own in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kvservice-loop", daemon=True)
    thread.start()
    try:
        running = running_server(config)
        start = asyncio.run_coroutine_threadsafe(running.__aenter__(), loop)
        server = start.result(THREAD_TIMEOUT_S)
        try:
            yield ThreadedServer(server, loop)
        finally:
            stop = asyncio.run_coroutine_threadsafe(running.__aexit__(None, None, None), loop)
            stop.result(THREAD_TIMEOUT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(THREAD_TIMEOUT_S)
        loop.close()


# -- `kvservice serve` as a child process ------------------------------------------------


def kvservice_command() -> list[str]:
    """The installed console script, or the module when it is not on this venv."""
    script = Path(sys.executable).with_name("kvservice")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvservice.cli"]


async def read_event(stream: asyncio.StreamReader, event: str) -> dict[str, Any]:
    """The first JSON log line whose event is ``event`` (stdout is a pipe, so the
    server logs JSON)."""
    while True:
        line = await stream.readline()
        if not line:
            raise AssertionError(f"the server exited before logging {event!r}")
        record: dict[str, Any] = json.loads(line)
        if record.get("event") == event:
            return record


@contextlib.asynccontextmanager
async def kvservice_serve(
    *flags: str, metrics: bool = False, env: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, dict[str, Any]]]:
    """``kvservice serve --port=0 <flags>`` (and ``--no-metrics`` unless ``metrics``),
    once it has written its startup line (event ``serving``): the process, its stdout
    and stderr pipes, and that line. Killed on exit if still running."""
    process = await asyncio.create_subprocess_exec(
        *kvservice_command(),
        "serve",
        "--port=0",
        *(() if metrics else ("--no-metrics",)),
        *flags,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        startup = await asyncio.wait_for(read_event(process.stdout, "serving"), TIMEOUT_S)
        yield process, startup
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def run_kvservice(*args: str) -> tuple[int, str, str]:
    """Run ``kvservice <args>`` to its end: (status, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *kvservice_command(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
