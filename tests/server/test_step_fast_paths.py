"""The cheaper Step path: ``omit_request_state``, the client's lazy request state, and
the request table's fast paths (no ledger work for an uncharged default tenant), each
checked against the full path it stands in for."""

from __future__ import annotations

import pytest

from kvservice.client import (
    AsyncKVClient,
    RequestStateOmittedError,
    RequestStatus,
    StepBuilder,
)
from kvservice.core.errors import QuotaExceededError
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server.config import build_manager
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_step import result_outcome, scenario
from tests.servers import raw_stub, running_server

BLOCK = SMALL_POOL.block_size


async def step_results(ops: list[pb.StepOperation], omit: bool) -> list[pb.StepResult]:
    async with running_server(SMALL_POOL) as server, raw_stub(server) as stub:
        response: pb.StepResponse = await stub.Step(
            pb.StepRequest(ops=ops, omit_request_state=omit)
        )
        return list(response.results)


# The results whose request state omit_request_state leaves out.
OMITTING = ("allocate_slots", "append_tokens")


async def test_omit_request_state_leaves_out_only_the_allocations_and_appends_state() -> None:
    """The same scenario on two fresh servers: with the flag, every AllocateSlots and
    AppendTokens answer is the full one less its ``request``; every other answer
    (errors, other operations' request states) is byte-identical."""
    ops = scenario()
    full = await step_results(ops, omit=False)
    lean = await step_results(ops, omit=True)
    assert len(full) == len(lean) == len(ops)
    omitted: list[str] = []
    for with_state, without in zip(full, lean, strict=True):
        kind = with_state.WhichOneof("result")
        if kind in OMITTING:
            omitted.append(kind)
            assert getattr(with_state, kind).HasField("request")
            assert not getattr(without, kind).HasField("request")
            getattr(with_state, kind).ClearField("request")
        assert result_outcome(without) == result_outcome(with_state)
    assert omitted.count("allocate_slots") >= 4
    assert omitted.count("append_tokens") >= 1


async def test_client_decodes_the_request_state_on_first_read() -> None:
    """Without the flag, ``Allocation.request`` is the server's state of the request
    (as GetRequest answers it), equal across two reads and two decodings."""
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        step = StepBuilder()
        step.add_request("a", tokens(2 * BLOCK))
        first = step.allocate_slots("a", 2 * BLOCK)
        second = step.allocate_slots("a", 1)
        results = await client.step(step)
        allocation = results[first]
        assert allocation is not None
        state = allocation.request
        assert (state.request_id, state.status) == ("a", RequestStatus.RUNNING)
        assert state.num_computed_tokens == 2 * BLOCK
        assert allocation.request is state  # decoded once, then kept
        assert results[first] == allocation
        assert hash(results[first]) == hash(allocation)
        later = results[second]
        assert later is not None and later != allocation
        assert later.request == await client.get_request("a")


async def test_client_raises_on_an_omitted_request_state() -> None:
    """With ``omit_request_state`` the blocks still arrive; reading ``request`` raises
    a clear error, and the allocation still compares and prints."""
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        step = StepBuilder(omit_request_state=True)
        step.add_request("a", tokens(BLOCK + 1))
        handle = step.allocate_slots("a", BLOCK + 1)
        results = await client.step(step)
        allocation = results[handle]
        assert allocation is not None
        assert allocation.new_block_ids == ((1, 2),)
        with pytest.raises(RequestStateOmittedError, match="omit_request_state"):
            _ = allocation.request
        assert "request=<omitted>" in repr(allocation)
        assert allocation == results[handle]
        # The server kept the state all the same.
        assert (await client.get_request("a")).num_computed_tokens == BLOCK + 1


@pytest.mark.parametrize("coalesce", [True, False])
async def test_client_raises_on_an_omitted_append_state(coalesce: bool) -> None:
    """An append of a step sent with ``omit_request_state`` reads as the omitted
    state: any field raises ``RequestStateOmittedError``, whether it travelled alone
    or in a columnar batch."""
    async with running_server(SMALL_POOL) as server, AsyncKVClient(server.handle.target) as client:
        step = StepBuilder(omit_request_state=True, coalesce=coalesce)
        step.add_request("a", tokens(BLOCK))
        handle = step.append_tokens("a", [7])
        results = await client.step(step)
        assert results.error(handle) is None
        with pytest.raises(RequestStateOmittedError, match="omit_request_state"):
            _ = results[handle].num_tokens
        assert (await client.get_request("a")).num_tokens == BLOCK + 1


def two_tenants(quotas: dict[str, int] | None = None) -> tuple[KVCacheManager, RequestTable]:
    manager = build_manager(SMALL_POOL)
    table = RequestTable(manager, quotas=quotas)
    table.add_request(NewRequest("d", tokens(3 * BLOCK)), tenant="")
    table.add_request(NewRequest("n", tokens(2 * BLOCK, start=500)), tenant="t")
    return manager, table


def test_uncharged_default_tenant_counts_what_named_tenants_do_not_hold() -> None:
    """No quota for the default tenant: its blocks are derived from the pool, and the
    per-tenant counts still match the blocks each tenant's requests hold."""
    manager, table = two_tenants(quotas={"t": 5})
    table.allocate_slots("d", AllocateArgs(num_new_tokens=3 * BLOCK), tenant="")
    table.allocate_slots("n", AllocateArgs(num_new_tokens=2 * BLOCK), tenant="t")
    assert table.tenant_blocks() == {"": 3, "t": 2}
    table.audit()
    table.free("d", FreeMode.FINISH, tenant="")
    assert table.tenant_blocks() == {"t": 2}
    table.free("n", FreeMode.PREEMPT, tenant="t")
    assert table.tenant_blocks() == {"t": 0}
    assert manager.block_pool.get_num_free_blocks() == SMALL_POOL.num_blocks - 1
    table.audit()


def test_default_tenant_with_a_quota_is_charged_and_refused() -> None:
    """A quota for the default tenant puts it back on the ledger: an allocation past
    it is refused and changes nothing."""
    manager, table = two_tenants(quotas={"": 2})
    free_before = manager.block_pool.get_num_free_blocks()
    with pytest.raises(QuotaExceededError, match="quota of 2"):
        table.allocate_slots("d", AllocateArgs(num_new_tokens=3 * BLOCK), tenant="")
    assert manager.block_pool.get_num_free_blocks() == free_before
    table.allocate_slots("d", AllocateArgs(num_new_tokens=2 * BLOCK), tenant="")
    table.allocate_slots("n", AllocateArgs(num_new_tokens=BLOCK), tenant="t")
    assert table.tenant_blocks() == {"": 2, "t": 1}
    table.audit()
