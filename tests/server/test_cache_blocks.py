"""What vLLM's async scheduler needs of a remote pool: ``CacheBlocks`` (vLLM's
``cache_blocks``, after a step's outputs came back) and ``num_in_flight_tokens`` on an
allocation (a sliding window releases blocks only below the processed tokens).

vLLM's own scheduler over these calls, step for step against its built-in manager, is
``tests/vllm/test_async_scheduler.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvservice.client import AllocateOptions, AsyncKVClient, StepBuilder
from kvservice.client.errors import InvalidArgumentError, OutOfRangeError, RequestNotFoundError
from tests.server.support import SMALL_POOL, tokens
from tests.servers import running_server

DELAYED = AllocateOptions(delay_cache_blocks=True)
# Full attention beside a 32-token sliding window: 80 usable blocks of 16 tokens.
WINDOW_POOL = dataclasses.replace(SMALL_POOL, num_blocks=81, sliding_window=32, max_model_len=512)


async def _hit_tokens(client: AsyncKVClient, request_id: str, prompt: list[int]) -> int:
    await client.add_request(request_id, prompt)
    hit = await client.get_computed_blocks(request_id)
    await client.free(request_id)
    return hit.num_computed_tokens


async def test_cached_blocks_are_hit_and_caching_again_changes_nothing() -> None:
    """An allocation that delayed caching leaves its blocks out of the prefix cache;
    CacheBlocks puts the full blocks its count covers in, and is idempotent."""
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        await client.add_request("0", tokens(40))
        assert await client.allocate_slots("0", 40, options=DELAYED)
        assert await _hit_tokens(client, "probe-0", tokens(40)) == 0
        await client.cache_blocks("0", 20)  # one full block
        assert await _hit_tokens(client, "probe-1", tokens(40)) == 16
        await client.cache_blocks("0", 40)
        usage = await client.get_usage()
        await client.cache_blocks("0", 40)  # idempotent
        await client.cache_blocks("0", 16)  # a smaller count: monotonic, nothing undone
        assert await client.get_usage() == usage
        assert await _hit_tokens(client, "probe-2", tokens(40)) == 32
        assert (await client.audit()).ok


async def test_a_refused_cache_blocks_names_the_reason_and_changes_nothing() -> None:
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        with pytest.raises(RequestNotFoundError, match="'ghost'"):
            await client.cache_blocks("ghost", 16)
        await client.add_request("0", tokens(40))
        assert await client.allocate_slots("0", 32, options=DELAYED)
        usage = await client.get_usage()
        for count in (33, 41, -1):  # past the computed tokens, the known ones; negative
            with pytest.raises(OutOfRangeError, match="cache_blocks"):
                await client.cache_blocks("0", count)
        assert await client.get_usage() == usage
        assert await _hit_tokens(client, "probe", tokens(40)) == 0
        assert (await client.audit()).ok


async def test_cache_blocks_is_an_operation_of_a_step_in_order() -> None:
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        step = StepBuilder()
        step.add_request("0", tokens(40))
        step.allocate_slots("0", 40, options=DELAYED)
        cached = step.cache_blocks("0", 40)
        step.add_request("1", tokens(40))
        lookup = step.get_computed_blocks("1")
        results = await client.step(step, stop_on_error=True)
        assert results.ok and results[cached] is None
        assert results[lookup].num_computed_tokens == 32


async def test_in_flight_tokens_keep_a_windows_blocks_for_this_call() -> None:
    """With 64 of 96 computed tokens still in flight, a 32-token window still reads
    blocks the processed 32 tokens put in view; the same call without them releases
    those blocks first."""
    async with running_server(WINDOW_POOL) as server, AsyncKVClient(server.handle.target) as client:
        free: list[int] = []
        for request_id, in_flight in (("kept", 64), ("released", 0)):
            await client.add_request(request_id, tokens(200, start=1000 * len(free)))
            assert await client.allocate_slots(request_id, 96)
            before = (await client.get_usage()).num_free_blocks
            options = AllocateOptions(num_in_flight_tokens=in_flight)
            assert await client.allocate_slots(request_id, 16, options=options)
            free.append((await client.get_usage()).num_free_blocks - before)
        kept, released = free
        assert released > kept
        with pytest.raises(InvalidArgumentError, match="num_in_flight_tokens"):
            await client.allocate_slots(
                "kept", 16, options=AllocateOptions(num_in_flight_tokens=-1)
            )
        assert (await client.audit()).ok
