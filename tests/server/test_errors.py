"""Every refusal: the status code, a message naming the problem, and no state change."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import structlog

from kvservice.client import _wire
from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from tests.server.support import (
    SMALL_POOL,
    add,
    admit,
    allocate,
    append,
    expect_error,
    free,
    lookup,
    snapshot,
    tokens,
)
from tests.servers import Stub, raw_stub, running_server

Code = grpc.StatusCode

# One call per RPC that names a request, each for an id the server never saw.
UNKNOWN_REQUEST_CALLS: dict[str, Callable[[Stub], Awaitable[Any]]] = {
    "AppendTokens": lambda s: append(s, "ghost", [1]),
    "GetComputedBlocks": lambda s: lookup(s, "ghost"),
    "AllocateSlots": lambda s: allocate(s, "ghost", 1),
    "FreeRequest": lambda s: free(s, "ghost", pb.FREE_MODE_FINISH),
    "GetRequest": lambda s: s.GetRequest(pb.GetRequestRequest(request_id="ghost")),
    "GetBlockIds": lambda s: s.GetBlockIds(pb.GetBlockIdsRequest(request_id="ghost")),
}


@pytest.fixture
async def running(stub: Stub) -> Stub:
    """A server holding one running request "a" (40 tokens) and one waiting "w"."""
    await add(stub, "a", tokens(40))
    await admit(stub, "a")
    await add(stub, "w", tokens(20, start=100))
    return stub


async def refused(stub: Stub, call: Awaitable[Any], code: grpc.StatusCode) -> str:
    """Expect ``code`` and check that the pool and both requests are unchanged."""
    before = await snapshot(stub, ["a", "w"])
    message = await expect_error(call, code)
    assert await snapshot(stub, ["a", "w"]) == before
    return message


class TestNotFound:
    @pytest.mark.parametrize("rpc", sorted(UNKNOWN_REQUEST_CALLS))
    async def test_unknown_request(self, running: Stub, rpc: str) -> None:
        """Every per-request RPC answers NOT_FOUND for an unknown id, naming it."""
        call = UNKNOWN_REQUEST_CALLS[rpc](running)
        message = await refused(running, call, Code.NOT_FOUND)
        assert "'ghost'" in message

    async def test_finished_request_is_forgotten(self, running: Stub) -> None:
        """After FINISH the id is unknown (and free to reuse)."""
        await free(running, "w", pb.FREE_MODE_FINISH)
        await expect_error(lookup(running, "w"), Code.NOT_FOUND)
        await add(running, "w", tokens(4))


class TestAlreadyExists:
    async def test_duplicate_add(self, running: Stub) -> None:
        """Adding a known id is refused and the original request is untouched."""
        message = await refused(running, add(running, "a", tokens(8)), Code.ALREADY_EXISTS)
        assert "'a' already exists" in message


class TestInvalidArgument:
    @pytest.mark.parametrize(
        ("fields", "fragment"),
        [
            ({"num_new_tokens": -1}, "num_new_tokens"),
            ({"num_new_tokens": 1, "num_lookahead_tokens": -2}, "num_lookahead_tokens"),
            ({"num_new_tokens": 1, "reserved_blocks": -1}, "reserved_blocks"),
            ({"num_new_tokens": 1, "num_encoder_tokens": -1}, "num_encoder_tokens"),
            ({"num_new_tokens": 1, "num_external_computed_tokens": -1}, "external"),
            ({"num_new_tokens": 1, "num_computed_tokens": -1}, "num_computed_tokens"),
            ({"num_new_tokens": 0}, "num_new_tokens must be greater than 0"),
        ],
    )
    async def test_bad_allocation_counts(
        self, running: Stub, fields: dict[str, Any], fragment: str
    ) -> None:
        """Negative counts and zero new tokens are refused before anything changes."""
        request = pb.AllocateSlotsRequest(request_id="a", **fields)
        message = await refused(running, running.AllocateSlots(request), Code.INVALID_ARGUMENT)
        assert fragment in message

    async def test_computed_tokens_without_blocks(self, running: Stub) -> None:
        """Claiming hit tokens without passing the hit's blocks is refused."""
        call = allocate(running, "w", 4, num_new_computed_tokens=16)
        assert "no new_computed_blocks" in await refused(running, call, Code.INVALID_ARGUMENT)

    @pytest.mark.parametrize(
        ("request_id", "prompt", "fragment"),
        [
            ("", [1, 2], "request_id"),
            ("x", [], "at least one token"),
            ("x", [1, -5, 2], "prompt_token_ids[1] = -5"),
        ],
    )
    async def test_bad_add(
        self, running: Stub, request_id: str, prompt: list[int], fragment: str
    ) -> None:
        """Empty ids, empty prompts and negative token ids are refused."""
        message = await refused(running, add(running, request_id, prompt), Code.INVALID_ARGUMENT)
        assert fragment in message

    async def test_multimodal_item_outside_the_prompt(self, running: Stub) -> None:
        """A multimodal item must lie inside the prompt and carry an identifier."""
        outside = pb.MultiModalFeature(identifier="img", offset=6, length=8)
        call = add(running, "x", tokens(10), mm_features=[outside])
        assert "does not lie inside" in await refused(running, call, Code.INVALID_ARGUMENT)
        anonymous = pb.MultiModalFeature(offset=0, length=4)
        call = add(running, "x", tokens(10), mm_features=[anonymous])
        assert "no identifier" in await refused(running, call, Code.INVALID_ARGUMENT)

    async def test_bad_append(self, running: Stub) -> None:
        """Appending nothing or a negative token id is refused."""
        await refused(running, append(running, "a", []), Code.INVALID_ARGUMENT)
        await refused(running, append(running, "a", [3, -1]), Code.INVALID_ARGUMENT)

    async def test_free_without_mode(self, running: Stub) -> None:
        """FreeRequest needs PREEMPT or FINISH."""
        call = free(running, "a", pb.FREE_MODE_UNSPECIFIED)
        assert "FREE_MODE_UNSPECIFIED" in await refused(running, call, Code.INVALID_ARGUMENT)


class TestOutOfRange:
    async def test_prompt_longer_than_max_model_len(self, running: Stub) -> None:
        """A prompt past max_model_len (128) is refused."""
        call = add(running, "x", tokens(129))
        assert "max_model_len 128" in await refused(running, call, Code.OUT_OF_RANGE)

    async def test_append_past_max_model_len(self, running: Stub) -> None:
        """A request may not grow past max_model_len."""
        await refused(running, append(running, "a", tokens(89)), Code.OUT_OF_RANGE)

    async def test_allocate_past_max_model_len(self, running: Stub) -> None:
        """Slots past max_model_len are refused."""
        call = allocate(running, "a", 89)
        assert "exceeds max_model_len" in await refused(running, call, Code.OUT_OF_RANGE)

    async def test_num_computed_tokens_past_max_model_len(self, running: Stub) -> None:
        """A client-set count past max_model_len is refused."""
        call = allocate(running, "a", 1, num_computed_tokens=500)
        await refused(running, call, Code.OUT_OF_RANGE)


class TestFailedPrecondition:
    async def test_lookup_for_a_running_request(self, running: Stub) -> None:
        """Prefix lookups are for waiting or preempted requests."""
        assert "running" in await refused(running, lookup(running, "a"), Code.FAILED_PRECONDITION)

    async def test_preempt_a_waiting_request(self, running: Stub) -> None:
        """Only a running request can be preempted."""
        call = free(running, "w", pb.FREE_MODE_PREEMPT)
        assert "WAITING" in await refused(running, call, Code.FAILED_PRECONDITION)

    async def test_computed_tokens_going_backwards(self, running: Stub) -> None:
        """num_computed_tokens may not drop below the last allocation's without a
        preemption."""
        await append(running, "a", [9])
        await allocate(running, "a", 1)  # the manager now remembers 40 computed
        call = allocate(running, "a", 1, num_computed_tokens=10)
        assert "backwards" in await refused(running, call, Code.FAILED_PRECONDITION)

    async def test_hit_block_ids_without_a_lookup(self, running: Stub) -> None:
        """Passing block ids back requires the lookup that produced them."""
        call = allocate(
            running,
            "w",
            4,
            num_new_computed_tokens=16,
            new_computed_block_ids=[pb.BlockIds(block_ids=[1])],
        )
        assert "GetComputedBlocks first" in await refused(running, call, Code.FAILED_PRECONDITION)


async def test_refusals_are_logged_with_method_request_and_status(running: Stub) -> None:
    """The interceptor logs the method, the request id, the client id ("-" without
    x-client-id), a call id and the status of a refusal."""
    with structlog.testing.capture_logs() as logs:
        await expect_error(add(running, "a", tokens(8)), Code.ALREADY_EXISTS)
        await expect_error(
            running.GetRequest(
                pb.GetRequestRequest(request_id="zz"),
                metadata=(("x-client-id", "sched-1"), ("x-request-id", "call-7")),
            ),
            Code.NOT_FOUND,
        )
    [entry] = [e for e in logs if e.get("status") == "ALREADY_EXISTS"]
    assert (entry["method"], entry["request_id"], entry["client_id"]) == ("AddRequest", "a", "-")
    assert entry["call_id"]
    [tagged] = [e for e in logs if e.get("status") == "NOT_FOUND"]
    assert (tagged["client_id"], tagged["call_id"]) == ("sched-1", "call-7")


class TestVocabulary:
    async def test_token_ids_outside_the_configured_vocabulary(self) -> None:
        """With --vocab-size, a prompt or appended token id at or past it is refused
        INVALID_ARGUMENT naming the field, index and value, on AddRequest,
        AppendTokens and a columnar append entry alike; nothing changes."""
        config = dataclasses.replace(SMALL_POOL, vocab_size=1000)
        async with running_server(config) as server, raw_stub(server) as stub:
            await add(stub, "a", tokens(40))
            await admit(stub, "a")
            await add(stub, "w", tokens(20, start=100))
            message = await refused(stub, add(stub, "x", [1, 999, 1000]), Code.INVALID_ARGUMENT)
            assert "prompt_token_ids[2] = 1000" in message and "vocab_size 1000" in message
            message = await refused(stub, append(stub, "a", [5, 4000]), Code.INVALID_ARGUMENT)
            assert "token_ids[1] = 4000" in message
            # One id (a decode's append) is checked at both ends as well.
            message = await refused(stub, append(stub, "a", [1000]), Code.INVALID_ARGUMENT)
            assert "token_ids[0] = 1000" in message and "vocab_size 1000" in message
            message = await refused(stub, append(stub, "a", [-3]), Code.INVALID_ARGUMENT)
            assert "token_ids[0] = -3" in message and "must be >= 0" in message
            before = await snapshot(stub, ["a", "w"])
            batch = pb.AppendTokensBatch(request_ids=["a"], token_ids=[1000])
            step = pb.StepRequest(ops=[pb.StepOperation(append_tokens_batch=batch)])
            answer = (await stub.Step(step)).results[0].append_tokens_batch
            assert [e.code for e in answer.errors] == [Code.INVALID_ARGUMENT.value[0]]
            assert "vocab_size 1000" in answer.errors[0].message
            assert await snapshot(stub, ["a", "w"]) == before
            config_answer = await stub.GetCacheConfig(pb.GetCacheConfigRequest())
            assert config_answer.vocab_size == 1000
            await add(stub, "edges", [0, 999])  # both ends of the vocabulary are in it

    async def test_no_upper_bound_by_default(self, stub: Stub) -> None:
        """The embedded default (vocab_size 0) refuses only negative ids."""
        await add(stub, "big", [0, 2**40])
        assert (await stub.GetCacheConfig(pb.GetCacheConfigRequest())).vocab_size == 0


class TestPackedPrompt:
    """``packed_prompt_token_ids``: the same request as ``prompt_token_ids``, and every
    malformed use refused INVALID_ARGUMENT with nothing changed."""

    async def test_packed_and_repeated_prompts_are_the_same_request(self, stub: Stub) -> None:
        prompt = tokens(40, start=70_000)
        await add(stub, "repeated", prompt)
        packed = await add(stub, "packed", [], packed_prompt_token_ids=pack_token_ids(prompt))
        assert packed.num_tokens == 40 and packed.num_block_hashes == 40 // 16
        await admit(stub, "repeated")
        # Same ids, same hashes: the packed request hits every full block just cached.
        assert (await lookup(stub, "packed")).num_computed_tokens == 32

    @pytest.mark.parametrize(
        ("fields", "expected"),
        [
            (
                {"prompt_token_ids": [1, 2], "packed_prompt_token_ids": pack_token_ids([1, 2])},
                "both prompt_token_ids (2 ids) and packed_prompt_token_ids (8 bytes)",
            ),
            (
                {"packed_prompt_token_ids": b"\x01\x00\x00\x00\x02"},
                "packed_prompt_token_ids holds 5 bytes, not a multiple of 4",
            ),
        ],
    )
    async def test_malformed_packed_prompts(
        self, running: Stub, fields: dict[str, Any], expected: str
    ) -> None:
        call = running.AddRequest(pb.AddRequestRequest(request_id="x", **fields))
        message = await refused(running, call, Code.INVALID_ARGUMENT)
        assert "'x'" in message and expected in message
        await add(running, "x", [1])  # the id was never taken

    async def test_out_of_vocabulary_names_the_packed_field(self) -> None:
        config = dataclasses.replace(SMALL_POOL, vocab_size=1000)
        async with running_server(config) as server, raw_stub(server) as stub:
            packed = pack_token_ids([1, 999, 1000])
            call = add(stub, "x", [], packed_prompt_token_ids=packed)
            message = await expect_error(call, Code.INVALID_ARGUMENT)
            assert "packed_prompt_token_ids[2] = 1000" in message


def test_the_client_packs_prompts_and_falls_back_for_ids_packing_cannot_hold() -> None:
    """The wire op the clients send: packed when every id fits in 32 unsigned bits;
    otherwise the repeated field, so the server's refusal names the id as given."""
    fits = _wire.add_request("r", [0, 5, 2**32 - 1]).message
    assert fits.packed_prompt_token_ids == pack_token_ids([0, 5, 2**32 - 1])
    assert not fits.prompt_token_ids
    for prompt in ([3, -1], [3, 2**32]):
        message = _wire.add_request("r", prompt).message
        assert list(message.prompt_token_ids) == prompt
        assert not message.packed_prompt_token_ids
