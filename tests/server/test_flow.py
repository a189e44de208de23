"""The scheduler's life cycle of a request, driven end to end over gRPC."""

from __future__ import annotations

import dataclasses

import grpc

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from tests.server.support import (
    SMALL_POOL,
    add,
    admit,
    allocate,
    append,
    block_ids,
    expect_error,
    free,
    ids,
    lookup,
    snapshot,
    state,
    tokens,
    usage,
)
from tests.servers import Stub, raw_stub, running_server


class TestHappyPath:
    async def test_prefill_decode_finish_and_prefix_reuse(self, stub: Stub) -> None:
        """A request is admitted, decodes into a new block and finishes; a second
        request with the same prompt reuses its cached full blocks."""
        added = await add(stub, "a", tokens(48))
        assert (added.status, added.num_tokens, added.num_block_hashes) == (
            pb.REQUEST_STATUS_WAITING,
            48,
            3,
        )

        miss = await lookup(stub, "a")
        assert (ids(miss.block_ids), miss.num_computed_tokens) == ([[]], 0)
        prefill = await admit(stub, "a", miss)
        assert prefill.outcome == pb.ALLOCATION_OUTCOME_OK
        assert ids(prefill.new_block_ids) == [[1, 2, 3]]
        assert prefill.request.status == pb.REQUEST_STATUS_RUNNING
        assert prefill.request.num_computed_tokens == 48

        # Decode: the sampled token needs a fourth block.
        assert (await append(stub, "a", [1000])).num_tokens == 49
        decode = await allocate(stub, "a", 1)
        assert decode.outcome == pb.ALLOCATION_OUTCOME_OK
        assert ids(decode.new_block_ids) == [[4]]
        assert decode.request.num_computed_tokens == 49
        assert await block_ids(stub, "a") == [[1, 2, 3, 4]]
        pool = await usage(stub)
        assert (pool.num_used_blocks, pool.num_free_blocks, pool.usage) == (4, 6, 0.4)

        finished = await free(stub, "a", pb.FREE_MODE_FINISH)
        assert finished.request.status == pb.REQUEST_STATUS_FINISHED
        assert finished.num_free_blocks == 10
        await expect_error(state(stub, "a"), grpc.StatusCode.NOT_FOUND)

        await add(stub, "b", tokens(48))
        hit = await lookup(stub, "b")
        # The hit stops short of the last block: its last token must be recomputed.
        assert (ids(hit.block_ids), hit.num_computed_tokens) == ([[1, 2]], 32)
        second = await admit(stub, "b", hit)
        assert second.outcome == pb.ALLOCATION_OUTCOME_OK
        assert len(ids(second.new_block_ids)[0]) == 1
        assert (await block_ids(stub, "b"))[0][:2] == [1, 2]
        assert second.request.num_computed_tokens == 48
        totals = await usage(stub)
        assert (totals.prefix_cache_queries, totals.prefix_cache_hits) == (96, 32)

    async def test_preempt_keeps_the_request_for_re_prefill(self, stub: Stub) -> None:
        """PREEMPT frees the blocks and resets the request to 0 computed tokens; it
        is re-admitted by hitting its own cached blocks."""
        await add(stub, "a", tokens(40))
        await admit(stub, "a")
        preempted = await free(stub, "a", pb.FREE_MODE_PREEMPT)
        assert preempted.request.status == pb.REQUEST_STATUS_PREEMPTED
        assert preempted.request.num_computed_tokens == 0
        assert preempted.request.num_preemptions == 1
        assert preempted.num_free_blocks == 10
        assert await block_ids(stub, "a") == [[]]

        readmitted = await admit(stub, "a")
        assert readmitted.outcome == pb.ALLOCATION_OUTCOME_OK
        assert (await block_ids(stub, "a"))[0][:2] == [1, 2]
        # Preempted lookups are kept out of the headline prefix cache counters.
        assert (await usage(stub)).prefix_cache_hits == 0

    async def test_reset_prefix_cache(self, stub: Stub) -> None:
        """Reset is refused while blocks are held and forgets cached prefixes after."""
        await add(stub, "a", tokens(40))
        await admit(stub, "a")
        refused: pb.ResetPrefixCacheResponse = await stub.ResetPrefixCache(
            pb.ResetPrefixCacheRequest()
        )
        assert not refused.reset
        await free(stub, "a", pb.FREE_MODE_FINISH)
        done: pb.ResetPrefixCacheResponse = await stub.ResetPrefixCache(
            pb.ResetPrefixCacheRequest()
        )
        assert done.reset
        await add(stub, "b", tokens(40))
        assert (await lookup(stub, "b")).num_computed_tokens == 0

    async def test_cache_config(self, stub: Stub) -> None:
        """GetCacheConfig reports the pool and the hashing parameters."""
        config: pb.GetCacheConfigResponse = await stub.GetCacheConfig(pb.GetCacheConfigRequest())
        assert (config.num_blocks, config.max_model_len) == (11, 128)
        assert (config.scheduler_block_size, config.hash_block_size) == (16, 16)
        assert config.hash_algo == "sha256"
        assert len(config.none_hash_seed_fingerprint) == 16
        assert config.model_name == "test-model"
        [group] = config.groups
        assert group.kind == pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION
        assert (group.block_size, group.num_kv_heads, group.head_size) == (16, 1, 8)
        assert group.dtype == "float32"
        assert len(group.layer_names) == 2
        assert not group.HasField("sliding_window")


class TestNoSpace:
    async def test_no_space_is_ok_and_changes_nothing(self, stub: Stub) -> None:
        """A request that does not fit gets an OK NO_SPACE answer; the pool and the
        request are as before, and it fits once blocks are freed."""
        await add(stub, "big", tokens(128))
        assert (await admit(stub, "big")).outcome == pb.ALLOCATION_OUTCOME_OK
        await add(stub, "c", tokens(48, start=500))
        await lookup(stub, "c")
        before = await snapshot(stub, ["big", "c"])

        # The count given for this call is rolled back with everything else.
        refused = await allocate(stub, "c", 32, num_computed_tokens=16)
        assert refused.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE
        assert ids(refused.new_block_ids) == []
        assert refused.request.status == pb.REQUEST_STATUS_WAITING
        assert await snapshot(stub, ["big", "c"]) == before

        await free(stub, "big", pb.FREE_MODE_FINISH)
        assert (await admit(stub, "c")).outcome == pb.ALLOCATION_OUTCOME_OK

    async def test_full_sequence_must_fit(self, stub: Stub) -> None:
        """full_sequence_must_fit refuses a chunk that fits when the whole prompt
        does not."""
        await add(stub, "big", tokens(100))
        await admit(stub, "big")
        await add(stub, "c", tokens(64, start=500))
        chunk = await allocate(stub, "c", 16, full_sequence_must_fit=True)
        assert chunk.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE
        assert (await allocate(stub, "c", 16)).outcome == pb.ALLOCATION_OUTCOME_OK


class TestComputedTokens:
    async def test_client_corrects_num_computed_tokens(self, stub: Stub) -> None:
        """num_computed_tokens set on AllocateSlots replaces the server's count before
        allocating (rejected draft tokens), then advances as usual."""
        await add(stub, "a", tokens(20))
        await admit(stub, "a")
        await append(stub, "a", [1, 2, 3])
        # Three draft slots were scheduled; two were rejected.
        spec = await allocate(stub, "a", 3)
        assert spec.request.num_computed_tokens == 23
        corrected = await allocate(stub, "a", 1, num_computed_tokens=21)
        assert corrected.outcome == pb.ALLOCATION_OUTCOME_OK
        assert corrected.request.num_computed_tokens == 22

    async def test_refused_call_restores_num_computed_tokens(self, stub: Stub) -> None:
        """An error after num_computed_tokens was given leaves the old count."""
        await add(stub, "a", tokens(20))
        await admit(stub, "a")
        await expect_error(
            allocate(stub, "a", 0, num_computed_tokens=5), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (await state(stub, "a")).num_computed_tokens == 20


class TestPrefixHitTransfer:
    async def test_hit_must_match_the_lookup(self, stub: Stub) -> None:
        """Block ids that are not the last lookup's answer are refused."""
        await add(stub, "a", tokens(48))
        await admit(stub, "a")
        await free(stub, "a", pb.FREE_MODE_FINISH)
        await add(stub, "b", tokens(48))
        forged = [pb.BlockIds(block_ids=[2, 1])]
        await expect_error(
            allocate(stub, "b", 32, num_new_computed_tokens=16, new_computed_block_ids=forged),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        hit = await lookup(stub, "b")
        before = await snapshot(stub, ["b"])
        await expect_error(
            allocate(stub, "b", 32, num_new_computed_tokens=16, new_computed_block_ids=forged),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert await snapshot(stub, ["b"]) == before
        assert ids(hit.block_ids) == [[1, 2]]

    async def test_stale_hit_is_aborted(self, stub: Stub) -> None:
        """A hit whose blocks lost their cache entry since the lookup is ABORTED; a
        fresh lookup then answers what the cache really holds."""
        await add(stub, "a", tokens(48))
        await admit(stub, "a")
        await free(stub, "a", pb.FREE_MODE_FINISH)
        await add(stub, "b", tokens(48))
        hit = await lookup(stub, "b")
        assert hit.num_computed_tokens == 32
        await stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
        message = await expect_error(
            allocate(
                stub,
                "b",
                16,
                num_new_computed_tokens=hit.num_computed_tokens,
                new_computed_block_ids=hit.block_ids,
            ),
            grpc.StatusCode.ABORTED,
        )
        assert "look the prefix up again" in message
        assert (await lookup(stub, "b")).num_computed_tokens == 0

    async def test_hit_evicted_by_another_allocation_is_aborted(self, stub: Stub) -> None:
        """Lookups take no references: allocations for other requests may evict the
        hit's free blocks before it is attached, which AllocateSlots detects."""
        await add(stub, "a", tokens(48))
        await admit(stub, "a")
        await free(stub, "a", pb.FREE_MODE_FINISH)
        await add(stub, "b", tokens(48))
        hit = await lookup(stub, "b")
        assert ids(hit.block_ids) == [[1, 2]]
        # Freed blocks queue last-block-first behind the never-used ones: 9 new
        # blocks take 4..10, then 3, then 2.
        await add(stub, "c", tokens(128, start=1000))
        await admit(stub, "c")
        await add(stub, "d", tokens(16, start=2000))
        await admit(stub, "d")
        before = await snapshot(stub, ["b", "c", "d"])
        message = await expect_error(admit(stub, "b", hit), grpc.StatusCode.ABORTED)
        assert "block 2" in message
        assert await snapshot(stub, ["b", "c", "d"]) == before


async def test_block_ids_to_zero() -> None:
    """With zeroing on, every freshly allocated block is reported once."""
    config = dataclasses.replace(SMALL_POOL, metrics_port=None, needs_kv_cache_zeroing=True)
    async with running_server(config) as server, raw_stub(server) as stub:
        await add(stub, "a", tokens(40))
        first = await admit(stub, "a")
        assert list(first.block_ids_to_zero) == ids(first.new_block_ids)[0] == [1, 2, 3]
        await append(stub, "a", [7])
        decode = await allocate(stub, "a", 1)
        assert list(decode.block_ids_to_zero) == []
