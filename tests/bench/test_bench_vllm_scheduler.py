"""``benchmarks/bench_vllm_scheduler.py`` runs end to end in its smallest configuration
(its figures are quoted in the README): every mode's row of every workload is printed,
and with async scheduling every kvservice mode decided as vLLM's ``AsyncScheduler``.
Never a timing."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator

import pytest

from benchmarks import bench_vllm_scheduler
from kvservice.bench.process_sampler import SamplerUnavailableError
from kvservice.client import COMPILED as CLIENT_COMPILED

MODES = (
    "vllm built-in",
    "kvservice in-process",
    "kvservice remote",
    "remote, vLLM hashes",
    "kvservice remote overlap",
    "overlap, vLLM hashes",
    "kvservice remote unix",
    "step socket",
    "socket, vLLM hashes",
    "socket overlap, hashes",
)


@pytest.fixture(autouse=True)
def _restore_kvservice_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The benchmark points KVSERVICE_TARGET at its child server, which is gone after.
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    monkeypatch.setenv("KVSERVICE_CONFIRM", "sync")
    monkeypatch.delenv("KVSERVICE_CLIENT_BLOCK_HASHES", raising=False)


def _rows(out: str, workload: str) -> None:
    for mode in MODES:
        assert re.search(rf"^{mode} +\d", out, re.MULTILINE), (workload, mode, out)


def test_bench_vllm_scheduler_async_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Both workloads in the engine's batch-queue order over the fake GPU."""
    argv = ["--async-scheduling", "--rounds", "1", "--steps", "2", "--forward-ms", "1"]
    assert bench_vllm_scheduler.main(argv) == 0
    out = capsys.readouterr().out
    for workload in bench_vllm_scheduler.ASYNC_WORKLOADS:
        assert f"\n{workload}, async scheduling (AsyncScheduler, batch queue 2" in out, out
    _rows(out, "async")
    assert out.count("decisions: every mode's scheduler outputs") == 2, out
    assert "DECISIONS DIFFER" not in out


def test_bench_vllm_scheduler_sync_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rounds", "1", "--steps", "2", "--workloads", "decode"]
    assert bench_vllm_scheduler.main(argv) == 0
    out = capsys.readouterr().out
    assert "\ndecode: 256 requests, 2 steps x 1 rounds" in out, out
    _rows(out, "decode")
    assert "async" not in out and "with forward" not in out
    assert out.count("load average") == 2, out


def test_the_sync_report_gives_the_engine_step_ratio_with_a_forward(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --forward-ms the sync table adds the ratio of whole engine steps: 10 ms of
    forward plus 4 ms of scheduler against 10 plus 6 is 14/16."""
    timing = bench_vllm_scheduler.Timing
    base = [timing(steps=10, seconds=0.04, cpu_seconds=0.04)]
    remote = [timing(steps=10, seconds=0.06, cpu_seconds=0.05)]
    modes = [
        bench_vllm_scheduler.Mode("vllm built-in", object, None),
        bench_vllm_scheduler.Mode("kvservice remote", object, "target"),
    ]
    args = argparse.Namespace(forward_ms=10.0, steps=10, rounds=1)
    runs = {"vllm built-in": base, "kvservice remote": remote}
    bench_vllm_scheduler._report("churn", modes, runs, args)
    out = capsys.readouterr().out
    assert "with forward" in out
    assert re.search(r"^kvservice remote .* 0\.88x$", out, re.M), out


def test_the_sync_report_sets_each_modes_cpu_against_in_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 26's scheduler-thread row, from one run: each mode's CPU over the in-process
    mode's, round by round (3 ms against 2 and 6 against 4 ms: 1.5x), the median."""
    timing = bench_vllm_scheduler.Timing
    modes = [
        bench_vllm_scheduler.Mode("vllm built-in", object, None),
        bench_vllm_scheduler.Mode(bench_vllm_scheduler.IN_PROCESS, object, None),
        bench_vllm_scheduler.Mode("kvservice remote", object, "target"),
    ]
    runs = {
        "vllm built-in": [timing(steps=10, seconds=0.05, cpu_seconds=0.05)] * 2,
        bench_vllm_scheduler.IN_PROCESS: [
            timing(steps=10, seconds=0.02, cpu_seconds=0.02),
            timing(steps=10, seconds=0.04, cpu_seconds=0.04),
        ],
        "kvservice remote": [
            timing(steps=10, seconds=0.03, cpu_seconds=0.03),
            timing(steps=10, seconds=0.06, cpu_seconds=0.06),
        ],
    }
    bench_vllm_scheduler._report(
        "churn", modes, runs, argparse.Namespace(forward_ms=0.0, steps=10, rounds=2)
    )
    out = capsys.readouterr().out
    assert "CPU vs in-process" in out
    assert re.search(r"^kvservice remote .* 1\.50x$", out, re.M), out
    assert re.search(r"^kvservice in-process .* 1\.00x$", out, re.M), out


def test_bench_vllm_scheduler_profile_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The profile names each manager's share of the step and its methods, the remote
    link's parts, what waiting costs the scheduler thread, and where the server's CPU
    went."""
    assert bench_vllm_scheduler.main(["--profile", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    for mode in (
        "vllm built-in",
        "kvservice in-process",
        "remote, vLLM hashes",
        "socket, vLLM hashes",
    ):
        assert re.search(
            rf"^{re.escape(mode)}: [\d.]+ ms a step sampled, the manager \d+%", out, re.M
        ), out
    assert re.search(r"^ +[\d.]+% +allocate_slots$", out, re.M), out
    assert "costing nothing would make the step" in out
    # The remote link's parts, each printed (a 3-step run may not sample every one);
    # those the client's compiled build runs, as unseen by the profiler.
    for part in bench_vllm_scheduler._LINK_PARTS.values():
        unseen = part in bench_vllm_scheduler._COMPILED_LINK_PARTS and CLIENT_COMPILED
        row = (
            rf" +- +{re.escape(part)}: compiled, unseen"
            if unseen
            else rf" +[\d.]+% +{re.escape(part)}"
        )
        assert re.search(rf"^{row}", out, re.M), (part, out)
    # What waiting costs the scheduler thread: in-process with and without the waits,
    # and remote, each with its difference to in-process.
    assert "the scheduler thread's CPU a churn step, unsampled" in out
    for name in (
        "in-process",
        "in-process, sleeping as long",
        "in-process, a stand-in busy as long",
        "remote, vLLM hashes",
        "socket, vLLM hashes",
    ):
        assert re.search(rf"^ +[\d.]+ ms +[+-][\d.]+  {re.escape(name)}$", out, re.M), (name, out)
        # The same runs by phase: schedule() without the flush, the flush, the update;
        # a remote manager's flush sends and checks a step, which takes this thread's CPU.
        phases = re.search(rf"^ +([\d.]+) +([\d.]+) +([\d.]+)  {re.escape(name)}$", out, re.M)
        assert phases, (name, out)
        if not name.startswith("in-process"):
            assert float(phases[2]) > 0, (name, out)
    # The server's own CPU, sampled where py-spy may read it (tests/bench/
    # test_process_sampler.py checks what the sampler finds).
    for mode in ("remote, vLLM hashes", "socket, vLLM hashes"):
        assert re.search(
            rf"^{mode}, its server: [\d.]+ ms CPU a step while sampled \(\d+ "
            r"samples\)|^the server was not sampled: py-spy",
            out,
            re.M,
        ), out
    # The scheduler's own step, natively, where py-spy may sample this process
    # (tests/bench/test_process_sampler.py); vLLM's own code is among its parts.
    for mode in ("kvservice in-process", "socket, vLLM hashes"):
        assert re.search(
            rf"^{mode}, the scheduler's step sampled natively \(\d+ samples"
            rf"|^{mode}: this process was not sampled natively: py-spy",
            out,
            re.M,
        ), out
    assert "vLLM's scheduler code (no kvservice frame under it)" in out or (
        "this process was not sampled natively" in out
    ), out
    # And the server natively, where perf may (tests/bench/test_native_sampler.py).
    assert re.search(
        r"^socket, vLLM hashes, its server: [\d.]+ ms CPU a step while sampled by perf "
        r"\(\d+ samples\), by the Step operation sampled:$"
        r"|^the server was not sampled natively: perf",
        out,
        re.M,
    ), out


def test_the_async_report_names_a_mode_that_decided_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    modes = [
        bench_vllm_scheduler.Mode(name, object, None)
        for name in ("vllm built-in", "kvservice in-process")
    ]

    def timing(decisions: str) -> bench_vllm_scheduler.Timing:
        return bench_vllm_scheduler.Timing(
            seconds=1.0, cpu_seconds=0.5, steps=10, gpu_seconds=0.1, decisions=decisions
        )

    runs = {"vllm built-in": [timing("a"), timing("b")], "kvservice in-process": [timing("a")] * 2}
    args = argparse.Namespace(forward_ms=10.0, steps=10, rounds=2)
    assert not bench_vllm_scheduler._report_async("decode", modes, runs, args)
    assert "DECISIONS DIFFER from vLLM's AsyncScheduler: kvservice in-process (round 1)" in (
        capsys.readouterr().out
    )


def test_a_server_py_spy_cannot_sample_is_reported_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where py-spy is missing or may not attach, the remote run still runs, and the
    profile says why the server was not sampled."""

    @contextlib.contextmanager
    def refused(pid: int) -> Iterator[None]:
        raise SamplerUnavailableError(f"py-spy could not sample the process {pid}")
        yield

    monkeypatch.setattr(bench_vllm_scheduler, "sampled", refused)
    ran = []
    mode = bench_vllm_scheduler.Mode("remote", object, "target", server_pid=1)
    with bench_vllm_scheduler._server_sampled(mode, steps=1):
        ran.append(True)
    assert ran == [True]
    assert "the server was not sampled: py-spy could not sample the process 1" in (
        capsys.readouterr().out
    )


def test_a_native_client_sample_counts_in_the_part_it_ran_under() -> None:
    """The link's parts by a frame the sample runs under, searched before the
    innermost kvservice frame; a stack with no kvservice frame is vLLM's."""
    step = ("churn (benchmarks/bench_vllm_scheduler.py:228)", "Scheduler.schedule (vllm/x.py:1)")
    manager = "kvservice/integrations/vllm/manager.py"
    take = (*step, f"KVServiceKVCacheManager.take_kv_cache_block_copies ({manager}:540)")
    flush = (
        *take,
        "ServerLink.flush (kvservice/integrations/vllm/server_link.py:647)",
        "CPyDef_step_link___StepLink___flush (__native_kvservice.c:1)",
    )
    part = bench_vllm_scheduler._client_part
    assert part((*flush, "CPyDef_step_log___StepLog___build (x.c:2)", "PyUpb_Message_New (y)")) == (
        "the link: building the Step (StepLog.build, StepBuilder)"
    )
    assert part(
        (*flush, "SocketSession.send (kvservice/client/step_socket.py:1)", "send (libc)")
    ) == ("the link: serializing and sending it (the socket's send included)")
    assert part((*flush, "Py_DECREF (object.h:1)")) == (
        "the link: the rest of sending and confirming (StepLink)"
    )
    allocate = (*step, f"KVServiceKVCacheManager.allocate_slots ({manager}:420)")
    assert part(
        (*allocate, "ServerLink.allocated (kvservice/integrations/vllm/server_link.py:550)")
    ) == ("the link: recording (ServerLink, StepLog)")
    core = (*allocate, "CPyDef_kv_cache_manager___KVCacheManager___allocate_slots (x.c:3)")
    assert (
        part((*core, "PyDict_GetItem (z)"))
        == "kvservice's core (compiled; the replica when remote)"
    )
    assert part(allocate) == "the vLLM adapter (kvservice/integrations/vllm)"
    assert part((*step, "Request.num_tokens (vllm/v1/request.py:9)")) == (
        "vLLM's scheduler code (no kvservice frame under it)"
    )
