"""Copy-on-write holds kept for the client (``StepRequest.keep_copy_holds``) and
released by it (``FreeRetainedBlocks``), over real gRPC: the holds a step's partial
hits take stay (both ends of each copy) until the session releases them in its own
order, as vLLM's scheduler frees ``take_kv_cache_block_copies``' retained blocks; a
release the session does not hold is refused and changes nothing; holds end with
their session.
"""

from __future__ import annotations

import re

import pytest

from kvservice.client import (
    AsyncKVClient,
    FailedPreconditionError,
    FreeMode,
    StepBuilder,
)
from kvservice.client.types import Allocation
from kvservice.server.app import KVCacheServer
from tests.server.support import HYBRID_POOL
from tests.server.test_partial_hits_remote import CHUNK, PROMPT, SHARING
from tests.servers import running_server


async def _share(client: AsyncKVClient, keep: bool) -> Allocation:
    """req0 computes PROMPT's first chunk; req1 hits it inside a block of each group,
    allocated in a step (keeping its holds or not): one copy per group."""
    await client.add_request("req0", PROMPT)
    assert await client.allocate_slots("req0", CHUNK, await client.get_computed_blocks("req0"))
    await client.add_request("req1", SHARING)
    hit = await client.get_computed_blocks("req1")
    step = StepBuilder(keep_copy_holds=keep)
    handle = step.allocate_slots("req1", 4, hit)
    allocation = (await client.step(step, stop_on_error=True))[handle]
    assert allocation is not None and len(allocation.block_copies_to_apply) == 2
    return allocation


def _held(server: KVCacheServer) -> dict[int, int]:
    return dict(server.table.manager.retained_holds)


async def test_kept_holds_stay_until_released_in_the_order_given() -> None:
    async with (
        running_server(HYBRID_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.open_session(30.0)
        allocation = await _share(client, keep=True)
        retained = [end for copy in allocation.block_copies_to_apply for end in copy]
        assert _held(server) == {block: 1 for block in retained}
        assert (await client.audit()).ok
        # req0 goes: its blocks stay out of the free queue while a hold is on them.
        await client.free("req0", FreeMode.FINISH)
        free = (await client.get_usage()).num_free_blocks
        sources = [src for src, _ in allocation.block_copies_to_apply]
        assert not any(server.table.manager.block_pool.blocks[s].ref_cnt == 0 for s in sources)
        # A block the session holds no hold on: refused, nothing released.
        unheld = next(b for b in range(1, HYBRID_POOL.num_blocks) if b not in retained)
        with pytest.raises(FailedPreconditionError, match=re.escape(f"block_ids[1] = {unheld}")):
            await client.free_retained_blocks([retained[0], unheld])
        assert _held(server) == {block: 1 for block in retained}
        # vLLM's order: each copy's source, then its destination.
        assert await client.free_retained_blocks(retained) == free + len(sources)
        assert _held(server) == {}
        queue = [b.block_id for b in server.table.manager.block_pool.free_block_queue]
        assert queue[-len(sources) :] == sources  # hashed: released last, evicted last
        with pytest.raises(FailedPreconditionError, match=re.escape("each hold is released once")):
            await client.free_retained_blocks(retained[:1])
        assert (await client.audit()).ok


async def test_without_keep_the_holds_end_with_the_step() -> None:
    async with (
        running_server(HYBRID_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await _share(client, keep=False)
        assert _held(server) == {}
        assert (await client.audit()).ok


async def test_keeping_holds_needs_a_session_and_runs_nothing_without_one() -> None:
    async with (
        running_server(HYBRID_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.add_request("req0", PROMPT)
        step = StepBuilder(keep_copy_holds=True)
        step.allocate_slots("req0", CHUNK)
        with pytest.raises(
            FailedPreconditionError, match=re.escape("keep_copy_holds without a session")
        ):
            await client.step(step)
        assert (await client.get_request("req0")).num_computed_tokens == 0
        with pytest.raises(FailedPreconditionError, match=re.escape("carries no session")):
            await client.free_retained_blocks([1])


async def test_holds_end_with_their_session_and_no_other_session_releases_them() -> None:
    async with (
        running_server(HYBRID_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
        AsyncKVClient(server.handle.target) as other,
    ):
        lease = await client.open_session(30.0)
        allocation = await _share(client, keep=True)
        retained = [end for copy in allocation.block_copies_to_apply for end in copy]
        await other.open_session(30.0)
        with pytest.raises(FailedPreconditionError, match=re.escape("holds none")):
            await other.free_retained_blocks(retained)
        assert _held(server) == {block: 1 for block in retained}
        # Closed keeping its requests: its holds go all the same.
        await lease.close(free_requests=False)
        assert _held(server) == {}
        assert server.table.num_requests == 2
        assert (await other.audit()).ok
