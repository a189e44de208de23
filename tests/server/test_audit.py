"""The Audit RPC and the periodic self-check on a real server: ok after a random
workload, and a corrupted pool (or ownership record) is reported, logged and counted."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvservice.client import AsyncKVClient
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server import forking
from kvservice.server.app import KVCacheServer
from kvservice.server.audit import AuditNotRunError, Auditor, AuditReport
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.forking import GRPC_FORK_SUPPORT_ENV
from kvservice.server.sessions import SessionPolicy, SessionRegistry
from tests.server.support import SMALL_POOL, tokens, usage
from tests.server.test_sessions import LEASE_POOL, metric, open_session, session_md, wait_until
from tests.server.test_tenants import TOKENS, auth, write_tokens_file
from tests.servers import TIMEOUT_S, Stub, kvservice_serve, raw_stub, running_server

# Without the periodic self-check: every audit counted is an Audit call.
NO_SELF_CHECK = dataclasses.replace(LEASE_POOL, audit_interval_s=0)


@pytest.fixture
def server_config() -> ServerConfig:
    return LEASE_POOL


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
        self, server: KVCacheServer, stub: Stub, seed: int
    ) -> None:
        live = await random_workload(stub, seed, num_ops=150)
        assert metric(server, "kvservice_allocations_total", result="ok") > 10
        report = await audit(stub)
        assert report.ok, list(report.violations)
        pool = await usage(stub)
        assert report.num_free_blocks + report.num_held_blocks == pool.num_blocks - 1
        assert report.num_held_blocks == pool.num_used_blocks
        assert report.num_cached_blocks <= report.num_free_blocks
        assert (report.num_requests, report.num_sessions) == (len(live), 1)
        assert report.num_owned_requests <= len(live)
        for rid in live:
            await stub.FreeRequest(pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH))
        report = await audit(stub)
        assert report.ok
        assert (report.num_held_blocks, report.num_requests, report.num_owned_requests) == (0, 0, 0)

    async def test_a_corrupted_pool_is_reported_logged_and_counted(
        self, server: KVCacheServer, stub: Stub, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert (await audit(stub)).ok
        # The test shares the server's loop, so this runs between two RPCs.
        block = server.table.manager.block_pool.blocks[5]
        block.ref_cnt += 1
        try:
            report = await audit(stub)
        finally:
            block.ref_cnt -= 1
        assert not report.ok
        assert any("block 5" in v for v in report.violations), list(report.violations)
        assert metric(server, "kvservice_audit_failures_total") == 1
        assert metric(server, "kvservice_audit_runs_total") == 2
        assert "pool audit failed" in capsys.readouterr().out
        assert (await audit(stub)).ok

    async def test_ownership_records_are_checked(self, server: KVCacheServer, stub: Stub) -> None:
        """A request the session owns but the request table lost is a violation."""
        session = await open_session(stub, ttl_s=600)
        await stub.AddRequest(
            pb.AddRequestRequest(request_id="owned", prompt_token_ids=tokens(4)),
            metadata=session_md(session.session_id),
        )
        lost = server.table._requests.pop("owned")  # test-only corruption
        try:
            report = await audit(stub)
        finally:
            server.table._requests["owned"] = lost
        assert not report.ok
        assert any("'owned'" in v and "does not know" in v for v in report.violations)
        assert (await audit(stub)).ok


class TestForkedAudit:
    """The snapshot audit large pools get, forced on for a small one."""

    def make(self) -> tuple[RequestTable, Auditor]:
        table = RequestTable(build_manager(SMALL_POOL))
        registry = SessionRegistry(table, SessionPolicy())
        for n in range(3):
            table.add_request(NewRequest(f"r{n}", tokens(20, start=n)), tenant=DEFAULT_TENANT)
            table.allocate_slots(f"r{n}", AllocateArgs(num_new_tokens=20), tenant=DEFAULT_TENANT)
        table.free("r1", FreeMode.FINISH, tenant=DEFAULT_TENANT)
        return table, Auditor(table, registry, fork_min_blocks=0)

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
        table, auditor = self.make()
        table.manager.block_pool.blocks[7].ref_cnt += 1
        report = await auditor.run()
        assert not report.ok
        assert any("block 7" in v for v in report.violations), report.violations

    async def test_a_stuck_child_is_killed_and_reported_as_not_run(self) -> None:
        table, _ = self.make()
        parent = os.getpid()

        class StuckInChild(Auditor):
            def check(self) -> AuditReport:
                if os.getpid() != parent:
                    time.sleep(600)  # a child stuck on a lock held at the fork
                return super().check()

        auditor = StuckInChild(table, None, fork_min_blocks=0, fork_timeout_s=0.5)
        with pytest.raises(AuditNotRunError, match="did not finish"):
            await auditor.run()
        assert (await Auditor(table, None, fork_min_blocks=0).run()).ok

    async def test_a_crashed_child_is_reported_as_not_run_never_checked_in_place(
        self,
    ) -> None:
        """The issue: children died with SIGSEGV and the server fell back to checking
        a 1M-block pool in place (6 s without serving). A child that dies is an audit
        that did not run: an error, counted, and nothing checked on the loop."""
        table, _ = self.make()
        parent = os.getpid()
        in_place: list[int] = []

        class CrashingChild(Auditor):
            def check(self) -> AuditReport:
                if os.getpid() != parent:
                    os.kill(os.getpid(), signal.SIGSEGV)
                in_place.append(1)
                return super().check()

        async with running_server(LEASE_POOL) as server:
            auditor = CrashingChild(table, None, server.metrics, fork_min_blocks=0)
            with pytest.raises(AuditNotRunError, match="killed by SIGSEGV"):
                await auditor.run()
            assert in_place == []
            assert metric(server, "kvservice_audit_errors_total") == 1
            assert metric(server, "kvservice_audit_failures_total") == 0

    async def test_the_child_runs_without_the_collector_or_the_parents_sockets(self) -> None:
        """What makes the child safe: no garbage collection (which could finalize a
        gRPC object in it), default signals, only its report pipe open."""
        table, _ = self.make()
        parent = os.getpid()

        class Inspecting(Auditor):
            def check(self) -> AuditReport:
                if os.getpid() != parent:
                    assert not gc.isenabled()
                    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
                    assert len(os.listdir("/proc/self/fd")) <= 5  # stdio, the pipe, listdir's
                return super().check()

        async with running_server(LEASE_POOL):  # its sockets are open in this process
            assert (await Inspecting(table, None, fork_min_blocks=0).run()).ok
        assert gc.isenabled()


class TestConcurrentAudits:
    """The issue: six concurrent Audit calls on a 1M-block pool forked six children."""

    async def test_concurrent_callers_share_one_run(self, monkeypatch: pytest.MonkeyPatch) -> None:
        forks: list[int] = []
        real_fork = forking.fork

        def counting_fork() -> int:
            pid = real_fork()
            if pid:
                forks.append(pid)
            return pid

        monkeypatch.setattr(forking, "fork", counting_fork)
        async with running_server(NO_SELF_CHECK) as server:
            auditor = server.auditor
            auditor._fork = True  # test-only: a large pool's path on a small one
            parent, check = os.getpid(), auditor.check

            def slow_check() -> AuditReport:
                if os.getpid() != parent:
                    time.sleep(1.0)  # a large pool's check, while the other calls arrive
                return check()

            monkeypatch.setattr(auditor, "check", slow_check)
            async with raw_stub(server) as stub:
                reports = await asyncio.gather(*(audit(stub) for _ in range(6)))
                assert all(r.ok for r in reports)
                assert len(forks) == 1
                assert metric(server, "kvservice_audit_runs_total") == 1
                # Once it is over, the next call runs anew.
                assert (await audit(stub)).ok
                assert len(forks) == 2

    async def test_a_cancelled_caller_leaves_the_run_to_the_others(self) -> None:
        _, auditor = TestForkedAudit().make()
        first = asyncio.ensure_future(auditor.run())
        second = asyncio.ensure_future(auditor.run())
        await asyncio.sleep(0)
        first.cancel()
        assert (await second).ok
        with pytest.raises(asyncio.CancelledError):
            await first

    async def test_audit_is_for_admin_tenants(self, tmp_path: Path) -> None:
        tokens_file = write_tokens_file(
            tmp_path / "t.toml",
            {
                "alpha": {"tokens": [TOKENS["alpha"]]},
                "beta": {"tokens": [TOKENS["beta"]], "admin": True},
            },
        )
        config = dataclasses.replace(LEASE_POOL, auth_tokens_file=tokens_file)
        async with running_server(config) as server, raw_stub(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Audit(pb.AuditRequest(), metadata=auth("alpha"))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (await stub.Audit(pb.AuditRequest(), metadata=auth("beta"))).ok

    def test_only_small_pools_are_checked_in_place(self) -> None:
        """In place, the check stops the loop: only under FORK_MIN_BLOCKS blocks,
        where it takes a few tens of milliseconds."""
        small = RequestTable(build_manager(dataclasses.replace(SMALL_POOL, num_blocks=8191)))
        large = RequestTable(build_manager(dataclasses.replace(SMALL_POOL, num_blocks=8192)))
        assert not Auditor(small).forks and Auditor(large).forks


class TestForkSafety:
    """A forked snapshot only where gRPC registered no fork handlers: the serve
    command turns them off before grpc is imported; another process gets a clear
    refusal instead of a child gRPC may crash."""

    def test_a_process_with_grpc_fork_handlers_refuses_to_fork(self, tmp_path: Path) -> None:
        script = tmp_path / "probe.py"
        script.write_text(
            "import asyncio, grpc\n"
            "from kvservice.request_table.table import RequestTable\n"
            "from kvservice.server.audit import Auditor, AuditUnavailableError\n"
            "from kvservice.server.config import ServerConfig, build_manager\n"
            "table = RequestTable(build_manager(ServerConfig(num_blocks=20000)))\n"
            "try:\n"
            "    asyncio.run(Auditor(table).run())\n"
            "except AuditUnavailableError as err:\n"
            "    print('refused:', err)\n"
        )
        env = {k: v for k, v in os.environ.items() if k != GRPC_FORK_SUPPORT_ENV}
        done = subprocess.run(
            [sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "refused:" in done.stdout and GRPC_FORK_SUPPORT_ENV in done.stdout

    async def test_kvservice_serve_forks_its_audit_without_grpc_fork_handlers(self) -> None:
        """A real `kvservice serve` on a pool large enough to fork: concurrent audits
        pass and gRPC never ran (nor skipped) its fork handlers."""
        env = {k: v for k, v in os.environ.items() if k != GRPC_FORK_SUPPORT_ENV}
        async with kvservice_serve(
            "--num-blocks=20000", "--max-model-len=1024", "--audit-interval=0", env=env
        ) as (process, serving):
            async with AsyncKVClient(f"127.0.0.1:{serving['port']}") as client:
                await client.add_request("r", tokens(1000))
                assert await client.allocate_slots("r", 1000) is not None
                reports = await asyncio.gather(*(client.audit() for _ in range(4)))
            assert all(r.ok and r.num_held_blocks == 63 for r in reports)
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        assert process.returncode == 0
        assert "fork" not in stderr.decode(), stderr.decode()


class TestSelfCheck:
    @pytest.mark.parametrize("forked", [False, True])
    async def test_the_self_check_runs_and_counts(self, forked: bool) -> None:
        # Built, then started: the self-check decides at start whether it may run.
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
        async with running_server(NO_SELF_CHECK) as server:
            async with AsyncKVClient(server.handle.target) as client:
                report = await client.audit()  # the RPC still works
                assert report.ok and report.num_free_blocks == 10
            assert metric(server, "kvservice_audit_runs_total") == 1
