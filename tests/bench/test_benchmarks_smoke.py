"""The repo's benchmark scripts run end to end in a tiny configuration: their figures
are quoted in notes, so they must keep working as the code under them changes. Only
that they run and print every row is checked, never a timing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import (
    bench_admission_layers,
    bench_core,
    bench_decode_layers,
    bench_grpc,
    bench_loop_stalls,
    bench_retention,
)
from kvservice.bench.measure import Sample


def test_bench_grpc_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Starts its own server and echo subprocesses on free loopback ports."""
    assert bench_grpc.main(["--requests", "32", "--rounds", "1", "--latency-samples", "20"]) == 0
    out = capsys.readouterr().out
    for row in (
        "grpc echo (floor)",
        "AllocateSlots",
        bench_grpc.IN_PROCESS,
        "Step, 256 ops per call, columnar",
        "StepStream 256 StepBuilder+omit, 1 in flight",
        "StepStream 256 StepBuilder+omit, 2 in flight",
        # The same steps on the server's step socket: every result is read (a failed
        # operation would raise).
        bench_grpc.STEP_SOCKET,
    ):
        assert row in out


def test_bench_core_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Its three workers (vLLM, kvservice pure and compiled) run every workload and
    agree on every decision."""
    assert bench_core.main(["--ops", "400", "--rounds", "1", "--big-pool", "20000"]) == 0
    out = capsys.readouterr().out
    for row in [spec.name for spec in bench_core.workloads(20_000)]:
        assert f"\n{row} " in out
    for line in (
        "median",
        "cost per op",
        "building a 20000-block pool",
        "admission-heavy: its",
        "a manager costing nothing beside them would reach",
    ):
        assert line in out
    # Every engine's hashing floor: what each hashed.
    floor = re.search(
        r"vLLM (\d+) blocks, pickle [\d.]+ s \+ sha256 [\d.]+ s = \d+% of its [\d.]+ s; "
        r"pure (\d+) blocks, .*; compiled (\d+) blocks, ",
        out,
    )
    assert floor is not None, out
    vllm_blocks, pure_blocks, compiled_blocks = map(int, floor.groups())
    # The sources remember shared blocks; the compiled build's C chain hashes every one.
    assert 0 < pure_blocks < vllm_blocks == compiled_blocks, floor.group(0)
    assert "DECISIONS DIFFER" not in out


def test_bench_core_baseline_tree(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A baseline tree's compiled core runs in a fourth worker, imported from that tree
    (not this repo's, which the venv's editable install points at), and makes the same
    decisions. A copy of this package and its build stands in for another revision's
    tree (building one with --baseline takes mypyc minutes)."""
    shutil.copytree(
        bench_core.REPO_ROOT / "kvservice",
        tmp_path / "kvservice",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    argv = ["--ops", "400", "--rounds", "1", "--big-pool", "20000", "--engines", "compiled"]
    assert bench_core.main([*argv, "--baseline-tree", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    copied = re.escape(str(tmp_path.resolve() / "kvservice" / "_compiled"))
    assert re.search(rf"baseline: block_pool {copied}/\S+\.so", out), out
    assert "compiled/baseline" in out
    assert re.search(r"\nadmission-heavy .*\d\.\d\d", out), out
    assert "DECISIONS DIFFER" not in out


def test_bench_core_baseline_unknown_revision() -> None:
    with pytest.raises(SystemExit, match="git rev-parse"):
        bench_core.baseline_tree("no-such-revision")


def test_bench_decode_layers_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench_decode_layers.main(["--requests", "8", "--steps", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    for layer in bench_decode_layers.LAYERS:
        assert f" {layer} " in out


def test_bench_admission_layers_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Every layer runs; the step path checks beforehand that every admission fits."""
    bench_admission_layers.main(["--requests", "4", "--steps", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    for layer in bench_admission_layers.LAYERS:
        assert f" {layer} " in out


def test_bench_retention_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Every policy serves the churn, kvservice's LRU decides as vLLM's, and every
    policy's cost row prints."""
    argv = ["--requests", "96", "--rounds", "1", "--ops", "400", "--big-pool", "20000"]
    assert bench_retention.main(argv) == 0
    out = capsys.readouterr().out
    for row in (*bench_retention.POLICIES, "lru ", "priority ", "pinned "):
        assert f"\n{row}" in out
    assert "disagree" not in out


def test_a_round_that_measured_no_cpu_is_left_out_of_the_cpu_ratio() -> None:
    """A tiny run can read no CPU time (the kernel updates a running thread's at ticks
    and switches): such rounds are skipped, and a way with none has no ratio."""
    throughputs = bench_grpc.Throughputs()
    for way, cpu_s in (("base", 0.0), ("way", 0.5), ("base", 1.0), ("way", 0.5)):
        throughputs.add(way, Sample(ops=100, wall_s=1.0, cpu_s=cpu_s))
    assert throughputs.cpu_ratio("way", "base") == pytest.approx(2.0)
    throughputs.add("idle", Sample(ops=100, wall_s=1.0, cpu_s=0.0))
    throughputs.add("idle", Sample(ops=100, wall_s=1.0, cpu_s=0.0))
    assert throughputs.cpu_ratio("idle", "base") is None


def test_bench_loop_stalls_idle_cost_smoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An idle server per stall-watch interval, each one's CPU a second printed."""
    monkeypatch.setattr(bench_loop_stalls, "IDLE_SECONDS", 0.2)
    bench_loop_stalls.idle_cost(rounds=1)
    out = capsys.readouterr().out
    for interval in bench_loop_stalls.IDLE_INTERVALS_S:
        assert re.search(
            rf"^  --loop-stall-interval={interval:g}: ([\d.]+ ms CPU a second|CPU not readable)",
            out,
            re.M,
        ), out
