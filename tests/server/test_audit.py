"""The Audit RPC and the periodic self-check on a real server: ok after a random
workload, and a corrupted pool (or ownership record) is reported, logged and counted."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvservice.client import AsyncKVClient
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.audit import Auditor, AuditReport
from kvservice.server.config import build_manager
from kvservice.server.sessions import SessionPolicy, SessionRegistry
from tests.server.support import SMALL_POOL, Stub, raw_stub, running_server, tokens, usage
from tests.server.test_sessions import LEASE_POOL, metric, open_session, session_md, wait_until


async def start(audit_interval_s: float = 0) -> KVCacheServer:
    server = KVCacheServer(dataclasses.replace(LEASE_POOL, audit_interval_s=audit_interval_s))
    await server.start()
    return server


@pytest.fixture
async def aserver() -> AsyncIterator[KVCacheServer]:
    async with running_server(LEASE_POOL) as server:
        yield server


@pytest.fixture
async def astub(aserver: KVCacheServer) -> AsyncIterator[Stub]:
    async with raw_stub(aserver) as stub:
        yield stub


async def audit(stub: Stub) -> pb.AuditResponse:
    report: pb.AuditResponse = await stub.Audit(pb.AuditRequest())
    return report


async def random_workload(stub: Stub, seed: int, num_ops: int) -> set[str]:
    """Seeded scheduler-like moves with shared prefixes, some under a session, some
    refused; returns the requests still known at the end."""
    rng = random.Random(seed)
    session = await open_session(stub, ttl_s=600)
    live: set[str] = set()
    for n in range(num_ops):
        rid = rng.choice([*live, f"r{n}"]) if live else f"r{n}"
        md = session_md(session.session_id) if rng.random() < 0.5 else ()
        move = rng.choice(["add", "admit", "decode", "preempt", "finish"])
        try:
            if move == "add" and rid not in live:
                prompt = tokens(rng.randint(1, 60), start=rng.choice([0, 0, 500]))
                await stub.AddRequest(
                    pb.AddRequestRequest(request_id=rid, prompt_token_ids=prompt), metadata=md
                )
                live.add(rid)
            elif move == "admit":
                await admit_or_decode(stub, rid, md, decode=False)
            elif move == "decode":
                await stub.AppendTokens(
                    pb.AppendTokensRequest(request_id=rid, token_ids=[rng.randint(0, 99)])
                )
                await admit_or_decode(stub, rid, md, decode=True)
            elif move == "preempt":
                await stub.FreeRequest(
                    pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_PREEMPT)
                )
            elif move == "finish":
                await stub.FreeRequest(
                    pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH), metadata=md
                )
                live.discard(rid)
        except grpc.aio.AioRpcError as err:
            # Wrong states and unknown ids are part of the workload; bugs are not.
            assert err.code() != grpc.StatusCode.INTERNAL, err.details()
    return live


async def admit_or_decode(
    stub: Stub, rid: str, md: tuple[tuple[str, str], ...], decode: bool
) -> None:
    state = (await stub.GetRequest(pb.GetRequestRequest(request_id=rid))).request
    if decode:
        call = pb.AllocateSlotsRequest(
            request_id=rid, num_new_tokens=max(1, state.num_tokens - state.num_computed_tokens)
        )
    else:
        hit = await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id=rid))
        call = pb.AllocateSlotsRequest(
            request_id=rid,
            num_new_tokens=state.num_tokens - hit.num_computed_tokens,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_block_ids=hit.block_ids,
        )
    await stub.AllocateSlots(call, metadata=md)


class TestAuditRpc:
    @pytest.mark.parametrize("seed", [1, 2, 3])
    async def test_ok_after_a_random_workload(
        self, aserver: KVCacheServer, astub: Stub, seed: int
    ) -> None:
        live = await random_workload(astub, seed, num_ops=150)
        assert metric(aserver, "kvservice_allocations_total", result="ok") > 10
        report = await audit(astub)
        assert report.ok, list(report.violations)
        pool = await usage(astub)
        assert report.num_free_blocks + report.num_held_blocks == pool.num_blocks - 1
        assert report.num_held_blocks == pool.num_used_blocks
        assert report.num_cached_blocks <= report.num_free_blocks
        assert (report.num_requests, report.num_sessions) == (len(live), 1)
        assert report.num_owned_requests <= len(live)
        for rid in live:
            await astub.FreeRequest(pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH))
        report = await audit(astub)
        assert report.ok
        assert (report.num_held_blocks, report.num_requests, report.num_owned_requests) == (0, 0, 0)

    async def test_a_corrupted_pool_is_reported_logged_and_counted(
        self, aserver: KVCacheServer, astub: Stub, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert (await audit(astub)).ok
        # The test shares the server's loop, so this runs between two RPCs.
        block = aserver.table.manager.block_pool.blocks[5]
        block.ref_cnt += 1
        try:
            report = await audit(astub)
        finally:
            block.ref_cnt -= 1
        assert not report.ok
        assert any("block 5" in v for v in report.violations), list(report.violations)
        assert metric(aserver, "kvservice_audit_failures_total") == 1
        assert metric(aserver, "kvservice_audit_runs_total") == 2
        assert "pool audit failed" in capsys.readouterr().out
        assert (await audit(astub)).ok

    async def test_ownership_records_are_checked(self, aserver: KVCacheServer, astub: Stub) -> None:
        """A request the session owns but the allocator lost is a violation."""
        session = await open_session(astub, ttl_s=600)
        await astub.AddRequest(
            pb.AddRequestRequest(request_id="owned", prompt_token_ids=tokens(4)),
            metadata=session_md(session.session_id),
        )
        lost = aserver.table._requests.pop("owned")  # test-only corruption
        try:
            report = await audit(astub)
        finally:
            aserver.table._requests["owned"] = lost
        assert not report.ok
        assert any("'owned'" in v and "does not know" in v for v in report.violations)
        assert (await audit(astub)).ok


class TestForkedAudit:
    """The snapshot audit large pools get, forced on for a small one."""

    def make(self) -> tuple[RequestTable, Auditor]:
        allocator = RequestTable(build_manager(SMALL_POOL))
        registry = SessionRegistry(allocator, SessionPolicy())
        for n in range(3):
            allocator.add_request(NewRequest(f"r{n}", tokens(20, start=n)))
            allocator.allocate_slots(f"r{n}", AllocateArgs(num_new_tokens=20))
        allocator.free("r1", FreeMode.FINISH)
        return allocator, Auditor(allocator, registry, fork_min_blocks=0)

    async def test_the_snapshot_reports_what_the_in_place_check_does(self) -> None:
        _, auditor = self.make()
        forked = await auditor.run()
        in_place = auditor.check()
        assert forked.ok
        assert dataclasses.replace(forked, duration_s=0) == dataclasses.replace(
            in_place, duration_s=0
        )
        assert (forked.num_held_blocks, forked.num_requests) == (4, 2)

    async def test_the_snapshot_sees_a_corruption(self) -> None:
        allocator, auditor = self.make()
        allocator.manager.block_pool.blocks[7].ref_cnt += 1
        report = await auditor.run()
        assert not report.ok
        assert any("block 7" in v for v in report.violations), report.violations

    async def test_a_stuck_child_is_killed_and_counted_as_a_failure(self) -> None:
        allocator, _ = self.make()
        parent = os.getpid()

        class StuckInChild(Auditor):
            def check(self) -> AuditReport:
                if os.getpid() != parent:
                    time.sleep(600)  # a child stuck on a lock held at the fork
                return super().check()

        auditor = StuckInChild(allocator, None, fork_min_blocks=0, fork_timeout_s=0.5)
        report = await auditor.run()
        assert not report.ok
        assert "did not finish" in report.violations[0]
        assert (await Auditor(allocator, None, fork_min_blocks=0).run()).ok


class TestSelfCheck:
    @pytest.mark.parametrize("forked", [False, True])
    async def test_the_self_check_runs_and_counts(self, forked: bool) -> None:
        server = KVCacheServer(dataclasses.replace(LEASE_POOL, audit_interval_s=0.05))
        server.auditor._fork = forked  # test-only: a large pool's path on a small one
        await server.start()
        try:

            async def ran_a_few_times() -> bool:
                return metric(server, "kvservice_audit_runs_total") >= 3

            await wait_until(ran_a_few_times, "the periodic self-check")
            assert metric(server, "kvservice_audit_failures_total") == 0
            assert metric(server, "kvservice_audit_last_success_timestamp_seconds") > 0
            block = server.table.manager.block_pool.blocks[3]
            block.ref_cnt += 1
            try:

                async def failed() -> bool:
                    return metric(server, "kvservice_audit_failures_total") >= 1

                await wait_until(failed, "the self-check to notice the corruption")
            finally:
                block.ref_cnt -= 1
        finally:
            await server.stop(grace=0)

    async def test_zero_disables_it(self) -> None:
        server = await start(audit_interval_s=0)
        try:
            async with AsyncKVClient(server.handle.target) as client:
                report = await client.audit()  # the RPC still works
                assert report.ok and report.num_free_blocks == 10
            assert metric(server, "kvservice_audit_runs_total") == 1
        finally:
            await server.stop(grace=0)
