"""``kvservice serve`` as a real process: it starts, reports SERVING and exits 0 on a
signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.server.app import SERVICE_NAME
from tests.servers import TIMEOUT_S, kvservice_serve, read_event, run_kvservice


async def health_status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S
        )
        status: int = reply.status
        return status


@contextlib.asynccontextmanager
async def serving(*flags: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, Any]]:
    """``kvservice serve`` on a free port with ``flags``, once it answers health checks
    as SERVING: the process and its startup line. Killed on exit if still running."""
    async with kvservice_serve("--num-blocks=64", "--max-model-len=256", *flags) as started:
        _, startup = started
        assert await health_status(startup["port"]) == health_pb2.HealthCheckResponse.SERVING
        yield started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_serve_until_signalled(sig: signal.Signals) -> None:
    """The server binds a free port, answers health checks, and on SIGTERM or SIGINT
    shuts down cleanly with exit code 0."""
    async with serving() as (process, startup):
        assert startup["metrics_url"] is None
        assert process.stdout is not None
        process.send_signal(sig)
        await asyncio.wait_for(read_event(process.stdout, "stopped"), TIMEOUT_S)
        _, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        assert process.returncode == 0, stderr.decode()


async def test_bad_pool_exits_with_a_message() -> None:
    """A pool too small for max_model_len is refused with a readable message."""
    status, _, stderr = await run_kvservice("serve", "--port=0", "--no-metrics", "--num-blocks=4")
    assert status == 2
    assert "max_model_len" in stderr or "max seq len" in stderr


async def test_the_startup_line_is_written_at_any_log_level() -> None:
    """With --port 0 the startup line is the only way to learn the port: a quieter log
    level keeps it (and drops the info lines around it)."""
    async with serving("--log-level=error") as (process, _):
        process.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        assert process.returncode == 0
        assert b'"stopped"' not in out  # an info line: below the level
