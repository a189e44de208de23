"""Log lines stay short whatever a caller sends: every caller-supplied string (request
ids, client and call ids, error messages quoting them, method paths) is cut."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from kvservice.protocol import CALL_ID_KEY, CLIENT_ID_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.log import LOG_VALUE_CHARS, clip
from tests.server.support import SMALL_POOL
from tests.server.test_tenants import TOKENS, write_tokens_file
from tests.servers import raw_stub, running_server

HUGE = "x" * 1_000_000
# A line may name a few clipped values and its own fields; nothing near a huge value.
MAX_LINE_CHARS = 4 * 1024


def line_sizes(logs: list[MutableMapping[str, Any]]) -> list[int]:
    return [len(json.dumps(entry, default=str)) for entry in logs]


async def test_a_refused_call_naming_a_huge_id_logs_a_short_line() -> None:
    """The issue's case: a refused call with a 1 MB request id logged it twice (2 MB
    line). Every line is now short, and says how long the value was."""
    # Under gRPC's 8 KiB metadata limit together (past it gRPC may refuse the call itself).
    metadata = ((CLIENT_ID_KEY, "c" * 3000), (CALL_ID_KEY, "k" * 3000))
    async with running_server(SMALL_POOL) as server, raw_stub(server) as stub:
        with structlog.testing.capture_logs() as logs:
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: stub.AppendTokens(pb.AppendTokensRequest(request_id=HUGE, token_ids=[1])),
                lambda: stub.AddRequest(
                    pb.AddRequestRequest(request_id=HUGE, prompt_token_ids=[1])
                ),
                lambda: stub.GetRequest(pb.GetRequestRequest(request_id=HUGE), metadata=metadata),
            ]
            for call in calls:  # one at a time: the lines come in this order
                with pytest.raises(grpc.aio.AioRpcError):
                    await call()
            stream = stub.StepStream(metadata=metadata)
            await stream.done_writing()
            async for _ in stream:
                pass
    refused = [entry for entry in logs if entry["event"] == "rpc refused"]
    assert len(refused) == 3
    assert max(line_sizes(logs)) < MAX_LINE_CHARS, logs
    assert [entry["method"] for entry in refused] == ["AppendTokens", "AddRequest", "GetRequest"]
    assert "1000000 chars" in refused[0]["request_id"]
    assert "3000 chars" in refused[2]["client_id"]


async def test_an_unauthenticated_call_to_a_long_path_logs_a_short_line(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(tmp_path / "t.toml", {"alpha": {"tokens": [TOKENS["alpha"]]}})
    config = dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)
    async with (
        running_server(config) as server,
        grpc.aio.insecure_channel(server.handle.target) as channel,
    ):
        call = channel.unary_unary("/kvservice.v1.KVCacheService/" + "M" * 4000)
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(grpc.aio.AioRpcError):
                await call(b"")
            # The client may hear the refusal before the server has logged it.
            for _ in range(500):
                if logs:
                    break
                await asyncio.sleep(0.01)
    assert [entry["event"] for entry in logs] == ["rpc refused"]
    assert max(line_sizes(logs)) < MAX_LINE_CHARS


def test_clip() -> None:
    assert clip("short") == "short"
    cut = clip("y" * 10_000)
    assert len(cut) < LOG_VALUE_CHARS + 30 and cut.endswith("(10000 chars)")
    assert clip("z" * 100, 10) == "z" * 10 + "...(100 chars)"


async def test_a_refused_authentication_names_the_callers_address(tmp_path: Path) -> None:
    """Failed-auth lines say where the call came from (to find a misconfigured client
    or a prober), for every reason."""
    tokens_file = write_tokens_file(tmp_path / "t.toml", {"alpha": {"tokens": [TOKENS["alpha"]]}})
    config = dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:
        with structlog.testing.capture_logs() as logs:
            for metadata in ((), (("authorization", "Bearer not-a-token"),)):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.GetUsage(pb.GetUsageRequest(), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Audit(
                    pb.AuditRequest(), metadata=(("authorization", f"Bearer {TOKENS['alpha']}"),)
                )
    refused = [entry for entry in logs if entry["event"] == "rpc refused"]
    assert [entry["reason"] for entry in refused] == [
        "unauthenticated",
        "unauthenticated",
        "permission_denied",
    ]
    assert all(entry["peer"].startswith("ipv4:127.0.0.1:") for entry in refused), refused
