"""The Step operations vLLM's KV connectors need, over real gRPC: a free that keeps the
request's blocks for the session (``pop_blocks_for_free``: released later with
``FreeRetainedBlocks``, or when the session ends), ``EvictBlocks`` for blocks whose KV
failed to load, limited to the caller's own blocks, and ``RemoveSkippedBlocks``. Each
refusal changes nothing.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvservice.client import (
    AsyncKVClient,
    FailedPreconditionError,
    FreeMode,
    OutOfRangeError,
    StepBuilder,
)
from tests.server.support import SMALL_POOL, tokens
from tests.servers import running_server

WINDOW_POOL = dataclasses.replace(
    SMALL_POOL, num_blocks=21, kv_cache_groups="full_attention,sliding_window:16"
)


async def _computed(client: AsyncKVClient, request_id: str, prompt: list[int]) -> list[int]:
    """Add and compute ``request_id``'s prompt in one chunk; its full-attention blocks."""
    await client.add_request(request_id, prompt)
    allocation = await client.allocate_slots(
        request_id, len(prompt), await client.get_computed_blocks(request_id)
    )
    assert allocation is not None
    return list(allocation.new_block_ids[0])


async def test_a_kept_free_holds_the_blocks_until_the_session_releases_them() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.open_session(30.0)
        blocks = await _computed(client, "req0", tokens(40))
        free = (await client.get_usage()).num_free_blocks
        step = StepBuilder(keep_copy_holds=True)
        step.free("req0", FreeMode.FINISH, keep_blocks=True)
        await client.step(step, stop_on_error=True)
        # Forgotten, but its blocks stay out of the pool until released.
        assert server.table.num_requests == 0
        assert (await client.get_usage()).num_free_blocks == free
        assert (await client.audit()).ok
        # vLLM frees them last block first.
        assert await client.free_retained_blocks(blocks[::-1]) == free + len(blocks)
        assert (await client.audit()).ok


async def test_a_kept_free_outside_a_sessions_step_is_refused_and_frees_nothing() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await _computed(client, "req0", tokens(40))
        step = StepBuilder()
        handle = step.free("req0", FreeMode.FINISH, keep_blocks=True)
        results = await client.step(step)
        with pytest.raises(FailedPreconditionError, match=re.escape("inside a session's Step")):
            results[handle]
        assert (await client.get_request("req0")).num_computed_tokens == 40
        assert server.table.num_requests == 1


async def test_kept_blocks_come_back_when_the_session_ends() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
        AsyncKVClient(server.handle.target) as auditor,
    ):
        lease = await client.open_session(30.0)
        await _computed(client, "req0", tokens(40))
        step = StepBuilder(keep_copy_holds=True)
        step.free("req0", FreeMode.FINISH, keep_blocks=True)
        await client.step(step, stop_on_error=True)
        await lease.close()
        usage = await auditor.get_usage()
        assert usage.num_used_blocks == 0
        assert (await auditor.audit()).ok


async def test_evict_blocks_drops_the_callers_cache_entries_only() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.open_session(30.0)
        mine = await _computed(client, "req0", tokens(40))
        pool = server.table.manager.block_pool
        assert pool.blocks[mine[0]].block_hash is not None
        # A block no request of the caller holds: refused, nothing evicted.
        unheld = next(b for b in range(1, SMALL_POOL.num_blocks) if b not in mine)
        step = StepBuilder(keep_copy_holds=True)
        handle = step.evict_blocks([mine[0], unheld])
        results = await client.step(step)
        with pytest.raises(FailedPreconditionError, match=re.escape(f"block_ids[1] = {unheld}")):
            results[handle]
        assert pool.blocks[mine[0]].block_hash is not None
        step = StepBuilder(keep_copy_holds=True)
        step.evict_blocks([mine[1], mine[0]])
        await client.step(step, stop_on_error=True)
        assert pool.blocks[mine[0]].block_hash is None
        assert pool.blocks[mine[1]].block_hash is None
        assert (await client.audit()).ok


async def test_remove_skipped_blocks_releases_what_the_window_no_longer_reads() -> None:
    async with (
        running_server(WINDOW_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await _computed(client, "req0", tokens(64))
        free = (await client.get_usage()).num_free_blocks
        step = StepBuilder()
        too_far = step.remove_skipped_blocks("req0", 65)
        results = await client.step(step)
        with pytest.raises(OutOfRangeError, match=re.escape("within the request's 64 computed")):
            results[too_far]
        assert (await client.get_usage()).num_free_blocks == free
        step = StepBuilder()
        handle = step.remove_skipped_blocks("req0", 64)
        # A 16-token window at token 64 reads block 3 only: blocks 0-2 of the window
        # group go back.
        assert (await client.step(step))[handle] == free + 3
        assert (await client.audit()).ok
