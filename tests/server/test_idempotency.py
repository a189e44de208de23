"""Idempotent retries on a real server: a call retried with its operation id is applied
once and answered identically; an id reused for another call is refused; refusals are
remembered too; and the client's opt-in retries survive a lost answer."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest

from kvservice.client import AsyncKVClient, KVServiceError
from kvservice.protocol import OPERATION_ID_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.idempotency import OperationCache, Outcome
from tests.server.support import expect_error, lookup, snapshot, tokens, usage
from tests.server.test_sessions import LEASE_POOL, metric, open_session, session_md
from tests.servers import Stub, raw_stub, running_server

Metadata = tuple[tuple[str, str], ...]


def op(operation_id: str, session_id: str = "") -> Metadata:
    md: Metadata = ((OPERATION_ID_KEY, operation_id),)
    return (*md, *session_md(session_id)) if session_id else md


@pytest.fixture
def server_config() -> ServerConfig:
    return LEASE_POOL


def admit_step(request_id: str, num_tokens: int) -> pb.StepRequest:
    return pb.StepRequest(
        step_id=7,
        ops=[
            pb.StepOperation(
                add_request=pb.AddRequestRequest(
                    request_id=request_id, prompt_token_ids=tokens(num_tokens)
                )
            ),
            pb.StepOperation(
                allocate_slots=pb.AllocateSlotsRequest(
                    request_id=request_id, num_new_tokens=num_tokens
                )
            ),
        ],
    )


class TestRetries:
    async def test_a_retried_allocation_is_applied_once(
        self, server: KVCacheServer, stub: Stub
    ) -> None:
        await stub.AddRequest(pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(40)))
        hit = await lookup(stub, "r")
        call = pb.AllocateSlotsRequest(
            request_id="r",
            num_new_tokens=40 - hit.num_computed_tokens,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_block_ids=hit.block_ids,
        )
        first = await stub.AllocateSlots(call, metadata=op("alloc-1"))
        after_first = await snapshot(stub, ["r"])
        again = await stub.AllocateSlots(call, metadata=op("alloc-1"))
        assert again == first
        assert first.outcome == pb.ALLOCATION_OUTCOME_OK
        assert await snapshot(stub, ["r"]) == after_first
        assert after_first[0].num_used_blocks == 3
        assert metric(server, "kvservice_idempotent_replays_total") == 1
        assert metric(server, "kvservice_allocations_total", result="ok") == 1
        # Without the id the same call is a new allocation (decode past the prompt).
        await stub.AppendTokens(pb.AppendTokensRequest(request_id="r", token_ids=[1] * 9))
        decode = await stub.AllocateSlots(
            pb.AllocateSlotsRequest(request_id="r", num_new_tokens=9), metadata=op("alloc-2")
        )
        assert decode.new_block_ids[0].block_ids != first.new_block_ids[0].block_ids

    async def test_a_retried_step_is_applied_once(self, stub: Stub) -> None:
        first = await stub.Step(admit_step("s", 33), metadata=op("step-1"))
        assert [r.WhichOneof("result") for r in first.results] == [
            "add_request",
            "allocate_slots",
        ]
        state = await snapshot(stub, ["s"])
        again = await stub.Step(admit_step("s", 33), metadata=op("step-1"))
        assert again == first
        assert await snapshot(stub, ["s"]) == state
        # Sent again as a new operation, the same step is refused: it did happen.
        fresh = await stub.Step(admit_step("s", 33), metadata=op("step-2"))
        assert fresh.results[0].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]

    async def test_a_refusal_is_replayed_even_after_the_state_changed(self, stub: Stub) -> None:
        """The retry gets the first answer, not a new run against today's state."""
        free = pb.FreeRequestRequest(request_id="late", mode=pb.FREE_MODE_FINISH)
        message = await expect_error(
            stub.FreeRequest(free, metadata=op("free-1")), grpc.StatusCode.NOT_FOUND
        )
        await stub.AddRequest(pb.AddRequestRequest(request_id="late", prompt_token_ids=tokens(4)))
        again = await expect_error(
            stub.FreeRequest(free, metadata=op("free-1")), grpc.StatusCode.NOT_FOUND
        )
        assert again == message
        assert (await usage(stub)).num_requests == 1

    async def test_the_same_id_for_another_call_is_refused(self, stub: Stub) -> None:
        add = pb.AddRequestRequest(request_id="a", prompt_token_ids=tokens(4))
        await stub.AddRequest(add, metadata=op("id-1"))
        before = await snapshot(stub, ["a"])
        other = pb.AddRequestRequest(request_id="b", prompt_token_ids=tokens(4))
        message = await expect_error(
            stub.AddRequest(other, metadata=op("id-1")), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert "'id-1'" in message and "different request" in message
        message = await expect_error(
            stub.AppendTokens(
                pb.AppendTokensRequest(request_id="a", token_ids=[1]), metadata=op("id-1")
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "'id-1'" in message and "AddRequest" in message
        assert await snapshot(stub, ["a"]) == before

    async def test_ids_are_scoped_by_session(self, stub: Stub) -> None:
        """Two sessions may use the same id for different calls."""
        one = await open_session(stub, ttl_s=600)
        two = await open_session(stub, ttl_s=600)
        for name, session in (("x", one), ("y", two)):
            add = pb.AddRequestRequest(request_id=name, prompt_token_ids=tokens(4))
            await stub.AddRequest(add, metadata=op("shared", session.session_id))
        assert (await usage(stub)).num_requests == 2

    @pytest.mark.parametrize("bad", ["", "x" * 129])
    async def test_malformed_ids_are_refused(self, stub: Stub, bad: str) -> None:
        add = pb.AddRequestRequest(request_id="a", prompt_token_ids=tokens(4))
        message = await expect_error(
            stub.AddRequest(add, metadata=op(bad)), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert OPERATION_ID_KEY in message
        assert (await usage(stub)).num_requests == 0

    async def test_the_memory_is_bounded(self) -> None:
        """Past the cache size the oldest id is forgotten: its retry runs again."""
        config = dataclasses.replace(LEASE_POOL, idempotency_cache_size=2)
        async with running_server(config) as server, raw_stub(server) as stub:
            calls = {
                f"op-{n}": pb.AddRequestRequest(request_id=f"r{n}", prompt_token_ids=[n])
                for n in range(3)
            }
            for operation_id, call in calls.items():
                await stub.AddRequest(call, metadata=op(operation_id))
            await stub.AddRequest(calls["op-2"], metadata=op("op-2"))  # remembered
            await expect_error(
                stub.AddRequest(calls["op-0"], metadata=op("op-0")),
                grpc.StatusCode.ALREADY_EXISTS,
            )


class LossyProxy:
    """A gRPC proxy in front of the server that forwards every call (bytes and
    metadata) and, for the first ``drops`` calls, throws the answer away and tells the
    client UNAVAILABLE: the call took effect but the client cannot know."""

    def __init__(self, target: str, drops: int) -> None:
        self.drops = drops
        self.forwarded = 0
        self._channel = grpc.aio.insecure_channel(target)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((self,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def service(self, details: Any) -> Any:
        forward = self._channel.unary_unary(details.method)

        async def handle(request: bytes, context: Any) -> bytes:
            md = tuple((k, v) for k, v in context.invocation_metadata() if k.startswith("x-"))
            try:
                answer: bytes = await forward(request, metadata=md)
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details())
            self.forwarded += 1
            if self.drops:
                self.drops -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "answer lost (test proxy)")
            return answer

        return grpc.unary_unary_rpc_method_handler(handle)

    async def __aenter__(self) -> LossyProxy:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop(0)
        await self._channel.close()


class TestClientRetries:
    async def test_a_lost_answer_is_retried_and_applied_once(self, server: KVCacheServer) -> None:
        async with (
            LossyProxy(server.handle.target, drops=2) as proxy,
            AsyncKVClient(f"127.0.0.1:{proxy.port}", retries=3) as client,
        ):
            await client.add_request("r", tokens(40))  # answer lost once, retried
            allocation = await client.allocate_slots("r", 40)  # lost once, retried
            assert allocation is not None
            assert allocation.request.num_computed_tokens == 40
            assert proxy.forwarded == 4
            usage_now = await client.get_usage()
            assert (usage_now.num_requests, usage_now.num_used_blocks) == (1, 3)
            assert metric(server, "kvservice_idempotent_replays_total") == 2
            assert (await client.audit()).ok

    async def test_without_retries_the_loss_surfaces(self, server: KVCacheServer) -> None:
        async with (
            LossyProxy(server.handle.target, drops=1) as proxy,
            AsyncKVClient(f"127.0.0.1:{proxy.port}") as client,
        ):
            with pytest.raises(KVServiceError) as info:
                await client.add_request("r", tokens(4))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            # It did take effect: a blind resend (no id) is refused.
            with pytest.raises(KVServiceError) as again:
                await client.add_request("r", tokens(4))
            assert again.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_the_memory_budget_evicts_the_oldest_answers() -> None:
    """Large answers are forgotten oldest first once over the byte budget."""
    cache = OperationCache(capacity=100, max_bytes=250)
    for n in range(3):
        cache.put(("", "", f"op-{n}"), Outcome("Step", b"d" * 16, pb.StepResponse, b"x" * 100))
    assert len(cache) == 2
    assert cache.get(("", "", "op-0")) is None
    assert cache.get(("", "", "op-2")) is not None
    # One answer alone over the budget is still kept: its retry is the likeliest.
    cache.put(("", "", "huge"), Outcome("Step", b"d" * 16, pb.StepResponse, b"x" * 1000))
    assert len(cache) == 1
    assert cache.get(("", "", "huge")) is not None
