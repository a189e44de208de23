"""The Python clients (async and blocking): plain values, None for no room, typed
errors, batched steps and stream sessions."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvservice.client import (
    AllocateOptions,
    AsyncKVClient,
    FailedPreconditionError,
    FreeMode,
    InvalidArgumentError,
    KVClient,
    KVServiceError,
    NotRunError,
    OutOfRangeError,
    ProbeOptions,
    RequestExistsError,
    RequestNotFoundError,
    RequestStatus,
    ServiceUnavailableError,
    StaleHitError,
    StepBuilder,
)
from tests.server.support import SMALL_POOL, tokens
from tests.servers import running_server, server_in_thread


class TestAsyncClient:
    async def test_lifecycle_returns_plain_values(self, client: AsyncKVClient) -> None:
        """add, lookup, allocate (with the hit), append, decode and free."""
        added = await client.add_request("a", tokens(48))
        assert (added.status, added.num_tokens, added.num_block_hashes) == (
            RequestStatus.WAITING,
            48,
            3,
        )
        hit = await client.get_computed_blocks("a")
        assert (hit.block_ids, hit.num_computed_tokens) == (((),), 0)
        allocation = await client.allocate_slots("a", 48, hit)
        assert allocation is not None
        assert allocation.new_block_ids == ((1, 2, 3),)
        assert allocation.request.status is RequestStatus.RUNNING
        await client.append_tokens("a", [7])
        decode = await client.allocate_slots("a", 1)
        assert decode is not None and decode.new_block_ids == ((4,),)
        assert await client.get_block_ids("a") == ((1, 2, 3, 4),)
        freed = await client.free("a")
        assert (freed.request.status, freed.num_free_blocks) == (RequestStatus.FINISHED, 10)

        await client.add_request("b", tokens(48))
        reuse = await client.get_computed_blocks("b")
        assert (reuse.block_ids, reuse.num_computed_tokens) == (((1, 2),), 32)
        assert await client.allocate_slots("b", 16, reuse) is not None
        usage = await client.get_usage()
        assert (usage.num_used_blocks, usage.prefix_cache_hits) == (3, 32)

    async def test_no_space_is_none(self, client: AsyncKVClient) -> None:
        """No room answers None, as vLLM's allocate_slots does, and changes nothing."""
        await client.add_request("big", tokens(128))
        assert await client.allocate_slots("big", 128) is not None
        await client.add_request("c", tokens(48, start=500))
        before = await client.get_request("c")
        assert await client.allocate_slots("c", 48, options=AllocateOptions()) is None
        assert await client.get_request("c") == before

    async def test_probe(self, client: AsyncKVClient) -> None:
        """Probe answers hit, blocks needed and fit, and a later lookup is unchanged."""
        await client.add_request("a", tokens(48))
        await client.allocate_slots("a", 48)
        await client.free("a")
        await client.add_request("b", tokens(100))
        probe = await client.probe("b")
        assert (probe.num_hit_tokens, probe.num_new_tokens) == (48, 52)
        # 4 new blocks plus the 3 free cached ones the hit would take off the queue.
        assert (probe.num_blocks_to_allocate, probe.would_fit) == (7, True)
        assert (await client.probe("b", 20)).num_new_tokens == 20
        assert not (await client.probe("b", options=ProbeOptions(reserved_blocks=8))).would_fit
        usage = await client.get_usage()
        # Probes neither count as prefix lookups nor take blocks off the free queue.
        assert (usage.prefix_cache_queries, usage.num_free_blocks) == (0, 10)

    @pytest.mark.parametrize(
        ("call", "error"),
        [
            ("get_request", RequestNotFoundError),
            ("duplicate", RequestExistsError),
            ("zero_tokens", InvalidArgumentError),
            ("too_long", OutOfRangeError),
            ("preempt_waiting", FailedPreconditionError),
        ],
    )
    async def test_typed_errors(
        self, client: AsyncKVClient, call: str, error: type[Exception]
    ) -> None:
        """Each refusal raises its own class, carrying the gRPC status."""
        await client.add_request("w", tokens(4))
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "get_request": lambda: client.get_request("ghost"),
            "duplicate": lambda: client.add_request("w", [1]),
            "zero_tokens": lambda: client.allocate_slots("w", 0),
            "too_long": lambda: client.append_tokens("w", tokens(200)),
            "preempt_waiting": lambda: client.free("w", FreeMode.PREEMPT),
        }
        with pytest.raises(error) as info:
            await calls[call]()
        assert isinstance(info.value, KVServiceError)
        assert isinstance(info.value.code, grpc.StatusCode)

    async def test_stale_hit(self, client: AsyncKVClient) -> None:
        """A hit evicted since the lookup raises StaleHitError (ABORTED)."""
        await client.add_request("a", tokens(48))
        await client.allocate_slots("a", 48)
        await client.free("a")
        await client.add_request("b", tokens(48))
        hit = await client.get_computed_blocks("b")
        assert await client.reset_prefix_cache()
        with pytest.raises(StaleHitError):
            await client.allocate_slots("b", 16, hit)

    async def test_cache_config(self, client: AsyncKVClient) -> None:
        config = await client.get_cache_config()
        assert (config.num_blocks, config.max_model_len, config.model_name) == (
            11,
            128,
            "test-model",
        )
        [group] = config.groups
        assert (group.kind, group.block_size, group.sliding_window) == ("full_attention", 16, None)

    async def test_step_builder(self, client: AsyncKVClient) -> None:
        """Handles read each result; a failed one raises its error or reports it."""
        step = StepBuilder()
        added = step.add_request("a", tokens(20))
        dup = step.add_request("a", [1])
        alloc = step.allocate_slots("a", 20)
        table = step.get_block_ids("a")
        usage = step.get_usage()
        results = await client.step(step)
        assert results[added].num_tokens == 20
        assert isinstance(results.error(dup), RequestExistsError)
        with pytest.raises(RequestExistsError):
            results[dup]
        allocation = results[alloc]
        assert allocation is not None and allocation.new_block_ids == ((1, 2),)
        assert results[table] == ((1, 2),)
        assert results[usage].num_used_blocks == 2
        assert (results.ok, list(results.errors), len(results)) == (False, [1], 5)

    async def test_stop_on_error(self, client: AsyncKVClient) -> None:
        step = StepBuilder()
        step.get_request("ghost")
        skipped = step.add_request("a", [1])
        results = await client.step(step, stop_on_error=True)
        assert isinstance(results.error(skipped), NotRunError)

    async def test_session(self, client: AsyncKVClient) -> None:
        """Steps over one stream, answered in order."""
        async with client.session() as session:
            first = StepBuilder()
            handle = first.add_request("a", tokens(20))
            assert (await session.step(first))[handle].num_tokens == 20
            second = StepBuilder()
            alloc = second.allocate_slots("a", 20)
            allocation = (await session.step(second))[alloc]
            assert allocation is not None and allocation.new_block_ids == ((1, 2),)

    async def test_session_send_pipelines_in_order(self, client: AsyncKVClient) -> None:
        """``send`` returns once the step is written; later steps may depend on
        earlier ones (they run in order), and each answer reaches its own step,
        whichever ``result()`` is awaited first; close reads any left unread."""
        session = client.session()
        add, allocate, usage_step = StepBuilder(), StepBuilder(), StepBuilder()
        added = add.add_request("a", tokens(20))
        allocated = allocate.allocate_slots("a", 20)
        usage = usage_step.get_usage()
        sent = [await session.send(s) for s in (add, allocate, usage_step)]
        assert (await sent[2].result())[usage].num_free_blocks == 10 - 2
        assert all(p.done() for p in sent)
        assert (await sent[0].result())[added].num_tokens == 20
        allocation = (await sent[1].result())[allocated]
        assert allocation is not None and allocation.new_block_ids == ((1, 2),)
        unread = await session.send(usage_step)
        await session.close()
        assert unread.done() and (await unread.result())[usage].num_free_blocks == 8

    async def test_session_over_the_limit(self) -> None:
        """A stream-level refusal raises the typed error from ``step``."""
        config = dataclasses.replace(SMALL_POOL, max_step_ops=1)
        async with (
            running_server(config) as server,
            AsyncKVClient(server.handle.target) as client,
            client.session() as session,
        ):
            step = StepBuilder()
            step.get_usage()
            step.get_usage()
            with pytest.raises(InvalidArgumentError):
                await session.step(step)

    async def test_unreachable_server(self) -> None:
        async with AsyncKVClient("127.0.0.1:1", timeout=5) as client:
            with pytest.raises(ServiceUnavailableError):
                await client.get_usage()


def test_sync_client_and_session() -> None:
    """The blocking client has the same methods; its session runs steps in order."""
    with server_in_thread(SMALL_POOL) as running, KVClient(running.target) as client:
        client.add_request("a", tokens(48))
        hit = client.get_computed_blocks("a")
        allocation = client.allocate_slots("a", 48, hit)
        assert allocation is not None and allocation.new_block_ids == ((1, 2, 3),)
        assert client.probe("a", 1).num_blocks_to_allocate == 1
        with pytest.raises(RequestNotFoundError):
            client.get_request("ghost")
        with client.session() as session:
            step = StepBuilder()
            appended = step.append_tokens("a", [5])
            decode = step.allocate_slots("a", 1)
            results = session.step(step)
            assert results[appended].num_tokens == 49
            decoded = results[decode]
            assert decoded is not None and decoded.new_block_ids == ((4,),)
            step = StepBuilder()
            freed = step.free("a", FreeMode.PREEMPT)
            assert session.step(step)[freed].request.status is RequestStatus.PREEMPTED
        batch = StepBuilder()
        usage = batch.get_usage()
        assert client.step(batch)[usage].num_free_blocks == 10
        assert client.reset_prefix_cache()  # nothing holds blocks any more
        assert client.get_cache_config().hash_algo == "sha256"
        running.call(running.server.audit)


def test_session_send_pipelines_steps_in_order() -> None:
    """``send`` returns before the answer: steps sent back to back run in the order
    sent (a later one may depend on an earlier one), each answer reaches its own
    ``PendingStep`` whichever is read first, and a failed step does not stop the next."""
    with (
        server_in_thread(SMALL_POOL) as running,
        KVClient(running.target) as client,
        client.session() as session,
    ):
        add = StepBuilder()
        added = add.add_request("a", tokens(32))
        allocate = StepBuilder()
        allocated = allocate.allocate_slots("a", 32)
        ghost = StepBuilder()
        ghost.append_tokens("ghost", [1])
        usage_step = StepBuilder()
        usage = usage_step.get_usage()
        pending = [session.send(s, stop_on_error=True) for s in (add, allocate, ghost)]
        last = session.send(usage_step)
        assert not any(p.done() for p in (*pending, last))
        # Reading the last answer first reads every earlier one into its own step.
        assert last.result()[usage].num_free_blocks == 10 - 2
        assert all(p.done() for p in pending)
        assert pending[0].result()[added].num_tokens == 32
        allocation = pending[1].result()[allocated]
        assert allocation is not None and allocation.new_block_ids == ((1, 2),)
        assert isinstance(pending[2].result().errors[0], RequestNotFoundError)
        assert pending[0].result() is pending[0].result()
        # Sent and never read: close reads it into its step before ending the stream.
        unread = session.send(usage_step)
        session.close()
        assert unread.done() and unread.result()[usage].num_free_blocks == 8
        running.call(running.server.audit)


def test_session_send_on_a_failed_stream_raises_in_result() -> None:
    """A stream the server ended answers every step still unread with the error."""
    config = dataclasses.replace(SMALL_POOL, max_step_ops=1)
    with server_in_thread(config) as running, KVClient(running.target) as client:
        session = client.session()
        over = StepBuilder()
        over.get_usage()
        over.get_usage()
        first = session.send(over)
        second = session.send(StepBuilder())
        with pytest.raises(InvalidArgumentError):
            first.result()
        with pytest.raises(KVServiceError):
            second.result()
        session.cancel()
