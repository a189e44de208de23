"""The repo's benchmark scripts run end to end in a tiny configuration: their figures
are quoted in notes, so they must keep working as the code under them changes. Only
that they run and print every row is checked, never a timing."""

from __future__ import annotations

import pytest

from benchmarks import bench_decode_layers, bench_grpc


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
    ):
        assert row in out


def test_bench_decode_layers_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench_decode_layers.main(["--requests", "8", "--steps", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    for layer in bench_decode_layers.LAYERS:
        assert f" {layer} " in out
