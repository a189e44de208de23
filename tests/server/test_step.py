"""Batched Step and StepStream: ordering, failure semantics, and equivalence with the
unary calls."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, NewRequest
from kvservice.server import converters
from kvservice.server.config import build_manager
from tests.server.support import SMALL_POOL, expect_error, tokens
from tests.servers import Stub, raw_stub, running_server

# The unary RPC of each StepOperation field.
RPC_OF = {
    "add_request": "AddRequest",
    "append_tokens": "AppendTokens",
    "get_computed_blocks": "GetComputedBlocks",
    "allocate_slots": "AllocateSlots",
    "free_request": "FreeRequest",
    "probe": "Probe",
    "get_request": "GetRequest",
    "get_block_ids": "GetBlockIds",
    "get_usage": "GetUsage",
    "admit": "Admit",
}
PREFIX = [0] * 16 + [1] * 16 + [2] * 16
HIT_123 = [pb.BlockIds(block_ids=[1, 2, 3])]
Outcome = tuple[Any, ...]


def op(**field: Any) -> pb.StepOperation:
    return pb.StepOperation(**field)


def scenario() -> list[pb.StepOperation]:
    """A scheduler's sequence with hits, NO_SPACE, probes, preemption and refusals;
    later operations depend on earlier ones (block ids are vLLM's, so known ahead)."""
    alloc = pb.AllocateSlotsRequest
    return [
        op(add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=[*PREFIX, 3, 3])),
        op(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="a")),
        op(probe=pb.ProbeRequest(request_id="a")),
        op(allocate_slots=alloc(request_id="a", num_new_tokens=50)),
        op(add_request=pb.AddRequestRequest(request_id="b", prompt_token_ids=[*PREFIX, 4])),
        op(add_request=pb.AddRequestRequest(request_id="b", prompt_token_ids=[9])),  # exists
        op(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="b")),
        op(
            allocate_slots=alloc(
                request_id="b",
                num_new_tokens=1,
                num_new_computed_tokens=48,
                new_computed_block_ids=HIT_123,
            )
        ),
        op(append_tokens=pb.AppendTokensRequest(request_id="a", token_ids=tokens(14))),
        op(allocate_slots=alloc(request_id="a", num_new_tokens=14)),
        op(append_tokens=pb.AppendTokensRequest(request_id="ghost", token_ids=[1])),
        op(add_request=pb.AddRequestRequest(request_id="big", prompt_token_ids=tokens(100))),
        op(probe=pb.ProbeRequest(request_id="big")),
        op(allocate_slots=alloc(request_id="big", num_new_tokens=100)),  # NO_SPACE
        op(free_request=pb.FreeRequestRequest(request_id="big", mode=pb.FREE_MODE_PREEMPT)),
        op(free_request=pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_PREEMPT)),
        op(allocate_slots=alloc(request_id="big", num_new_tokens=0)),  # invalid
        op(get_block_ids=pb.GetBlockIdsRequest(request_id="b")),
        op(get_request=pb.GetRequestRequest(request_id="a")),
        op(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="a")),
        op(free_request=pb.FreeRequestRequest(request_id="b", mode=pb.FREE_MODE_FINISH)),
        op(get_usage=pb.GetUsageRequest()),
        op(allocate_slots=alloc(request_id="big", num_new_tokens=100)),
        op(get_usage=pb.GetUsageRequest()),
    ]


def result_outcome(result: pb.StepResult) -> Outcome:
    kind = str(result.WhichOneof("result"))
    if kind == "error":
        return ("error", result.error.code, result.error.message)
    return (kind, getattr(result, kind).SerializeToString(deterministic=True))


async def unary_outcome(stub: Stub, operation: pb.StepOperation) -> Outcome:
    kind = str(operation.WhichOneof("op"))
    try:
        response = await getattr(stub, RPC_OF[kind])(getattr(operation, kind))
    except grpc.aio.AioRpcError as err:
        return ("error", err.code().value[0], err.details())
    return (kind, response.SerializeToString(deterministic=True))


@pytest.fixture
async def fresh_stub() -> AsyncIterator[Callable[[], Awaitable[Stub]]]:
    """A factory of stubs, each on a server of its own (same config, fresh pool)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start() -> Stub:
            server = await stack.enter_async_context(running_server(SMALL_POOL))
            return await stack.enter_async_context(raw_stub(server))

        yield start


async def test_unary_step_and_stream_agree(fresh_stub: Any) -> None:
    """The same operations sent as unary calls, as one Step and as StepStream messages
    of three operations give byte-identical answers (errors included)."""
    ops = scenario()
    unary_stub, step_stub, stream_stub = await fresh_stub(), await fresh_stub(), await fresh_stub()

    unary = [await unary_outcome(unary_stub, o) for o in ops]

    response: pb.StepResponse = await step_stub.Step(pb.StepRequest(step_id=7, ops=ops))
    assert response.step_id == 7
    batched = [result_outcome(r) for r in response.results]

    call = stream_stub.StepStream()
    streamed: list[Outcome] = []
    for step_id, start in enumerate(range(0, len(ops), 3)):
        chunk = ops[start : start + 3]
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(step_id=step_id, ops=chunk)))
        reply: pb.StepStreamResponse = await call.read()
        assert reply.step.step_id == step_id
        streamed += [result_outcome(r) for r in reply.step.results]
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK

    assert batched == unary
    assert streamed == unary
    kinds = [o[0] for o in unary]
    assert kinds.count("error") == 4  # duplicate add, ghost, preempt waiting, zero tokens
    no_space = pb.AllocateSlotsResponse.FromString(unary[13][1])
    assert no_space.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE
    hit = pb.AllocateSlotsResponse.FromString(unary[7][1])
    assert [list(g.block_ids) for g in hit.new_block_ids] == [[5]]


class TestStepSemantics:
    async def test_failed_op_changes_nothing_and_later_ops_run(self, stub: Stub) -> None:
        """A refused operation answers its status; the ones after it still run."""
        response: pb.StepResponse = await stub.Step(
            pb.StepRequest(
                ops=[
                    op(add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=[1])),
                    op(add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=[2])),
                    op(allocate_slots=pb.AllocateSlotsRequest(request_id="a", num_new_tokens=1)),
                ]
            )
        )
        first, second, third = response.results
        assert first.add_request.request.num_tokens == 1
        assert second.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
        assert "already exists" in second.error.message
        assert third.allocate_slots.outcome == pb.ALLOCATION_OUTCOME_OK

    async def test_stop_on_error_skips_the_rest(self, stub: Stub) -> None:
        """With stop_on_error the operations after a failure answer CANCELLED unrun."""
        response: pb.StepResponse = await stub.Step(
            pb.StepRequest(
                stop_on_error=True,
                ops=[
                    op(get_request=pb.GetRequestRequest(request_id="ghost")),
                    op(add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=[1])),
                ],
            )
        )
        codes = [r.error.code for r in response.results]
        assert codes == [grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.CANCELLED.value[0]]
        await expect_error(
            stub.GetRequest(pb.GetRequestRequest(request_id="a")), grpc.StatusCode.NOT_FOUND
        )

    async def test_stop_on_error_mid_step(self, stub: Stub) -> None:
        """The operations before the failure stay applied; every one after it answers
        CANCELLED and none of them runs."""
        response: pb.StepResponse = await stub.Step(
            pb.StepRequest(
                stop_on_error=True,
                ops=[
                    op(add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=[1])),
                    op(allocate_slots=pb.AllocateSlotsRequest(request_id="a", num_new_tokens=0)),
                    op(add_request=pb.AddRequestRequest(request_id="b", prompt_token_ids=[1])),
                    op(allocate_slots=pb.AllocateSlotsRequest(request_id="a", num_new_tokens=1)),
                    op(get_usage=pb.GetUsageRequest()),
                ],
            )
        )
        kinds = [r.WhichOneof("result") for r in response.results]
        assert kinds == ["add_request", "error", "error", "error", "error"]
        codes = [r.error.code for r in response.results[1:]]
        cancelled = grpc.StatusCode.CANCELLED.value[0]
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT.value[0], *[cancelled] * 3]
        state = await stub.GetRequest(pb.GetRequestRequest(request_id="a"))
        assert (state.request.status, state.request.num_computed_tokens) == (
            pb.REQUEST_STATUS_WAITING,
            0,
        )
        await expect_error(
            stub.GetRequest(pb.GetRequestRequest(request_id="b")), grpc.StatusCode.NOT_FOUND
        )

    async def test_empty_operation_is_invalid(self, stub: Stub) -> None:
        """An operation with no field set is refused on its own."""
        response: pb.StepResponse = await stub.Step(pb.StepRequest(ops=[pb.StepOperation()]))
        assert response.results[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    async def test_empty_step(self, stub: Stub) -> None:
        """A step without operations answers an empty result list."""
        response: pb.StepResponse = await stub.Step(pb.StepRequest(step_id=3))
        assert (response.step_id, len(response.results)) == (3, 0)


async def test_step_over_the_limit_runs_nothing() -> None:
    """Unary: INVALID_ARGUMENT and no operation run. Stream: the stream ends with
    INVALID_ARGUMENT after answering the steps before it."""
    config = dataclasses.replace(SMALL_POOL, max_step_ops=2)
    adds = [
        op(add_request=pb.AddRequestRequest(request_id=f"r{i}", prompt_token_ids=[1]))
        for i in range(3)
    ]
    async with running_server(config) as server, raw_stub(server) as stub:
        message = await expect_error(
            stub.Step(pb.StepRequest(ops=adds)), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert "at most 2" in message
        assert server.table.num_requests == 0

        call = stub.StepStream()
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(ops=adds[:2])))
        assert len((await call.read()).step.results) == 2
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(ops=adds)))
        await expect_error(call.read(), grpc.StatusCode.INVALID_ARGUMENT)
        assert server.table.num_requests == 2


class TestHotPathEncoding:
    """The Step path's shortcuts answer what the plain protobuf code would."""

    def test_allocate_args_cache_tells_every_argument_apart(self) -> None:
        """Each scalar field, and the presence of each optional one, leads to its own
        arguments; the request id does not."""
        base = pb.AllocateSlotsRequest(request_id="a", num_new_tokens=1)
        variants = [base]
        for f in pb.AllocateSlotsRequest.DESCRIPTOR.fields:
            if f.has_presence or f.name in (
                "request_id",
                "num_new_tokens",
                "new_computed_block_ids",
            ):
                continue
            changed = pb.AllocateSlotsRequest()
            changed.CopyFrom(base)
            value: Any = True if f.type == f.TYPE_BOOL else 3
            setattr(changed, f.name, value)
            variants.append(changed)
        # Present but equal to the default: not the same as absent for the optionals.
        variants.append(pb.AllocateSlotsRequest(num_new_tokens=1, has_scheduled_reqs=False))
        variants.append(pb.AllocateSlotsRequest(num_new_tokens=1, num_computed_tokens=3))
        variants.append(pb.AllocateSlotsRequest(num_new_tokens=1, num_computed_tokens=0))
        args = [converters.allocate_args_from_pb(v) for v in variants]
        assert len(set(args)) == len(variants)
        assert args[-3].options.has_scheduled_reqs is False
        assert args[-1].num_computed_tokens == 0
        assert args[0].options.has_scheduled_reqs is True and args[0].num_computed_tokens is None
        other_id = pb.AllocateSlotsRequest(request_id="zz", num_new_tokens=1)
        assert converters.allocate_args_from_pb(other_id) == args[0]

    def test_allocate_args_with_a_hit_are_read_whole(self) -> None:
        msg = pb.AllocateSlotsRequest(
            request_id="a",
            num_new_tokens=1,
            num_new_computed_tokens=48,
            new_computed_block_ids=HIT_123,
        )
        args = converters.allocate_args_from_pb(msg)
        assert (args.new_computed_block_ids, args.num_new_computed_tokens) == (((1, 2, 3),), 48)

    def test_request_state_fill_matches_the_constructor(self) -> None:
        """Written field by field, the state serializes to the bytes of the message
        built in one go (zero fields included, which proto3 leaves out)."""
        manager = build_manager(SMALL_POOL)
        table = RequestTable(manager)
        request = table.add_request(NewRequest("r", tokens(20)), tenant=DEFAULT_TENANT)
        table.allocate_slots("r", AllocateArgs(num_new_tokens=20), tenant=DEFAULT_TENANT)
        expected = pb.RequestState(
            request_id="r",
            status=pb.REQUEST_STATUS_RUNNING,
            num_tokens=20,
            num_prompt_tokens=20,
            num_computed_tokens=20,
            num_preemptions=0,
            num_block_hashes=1,
        )
        filled = pb.AllocateSlotsResponse()
        converters.fill_request_state(filled.request, request)
        assert filled.request.SerializeToString() == expected.SerializeToString()
        assert converters.request_state_to_pb(request) == expected

    def test_empty_block_groups_survive(self) -> None:
        """An allocation that hands out no block still answers one (empty) group per KV
        cache group, as the unary answer does."""
        out = pb.AllocateSlotsResponse()
        converters.add_block_ids(out.new_block_ids, ([], [7, 8]))
        assert [list(g.block_ids) for g in out.new_block_ids] == [[], [7, 8]]
        again = pb.AllocateSlotsResponse.FromString(out.SerializeToString())
        assert len(again.new_block_ids) == 2
