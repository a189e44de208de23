"""benchmarks/bench_offload_index.py runs end to end in a tiny configuration (its figures
are quoted in notes): a row per policy and tier size, and both engines decide alike on
the whole stream. Never a timing."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_offload_index


def test_bench_offload_index_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--chunks", "300,1000", "--rounds", "2", "--requests", "40"]
    assert bench_offload_index.main(argv) == 0
    out = capsys.readouterr().out
    for policy in bench_offload_index.POLICIES:
        for chunks in ("300", "1,000"):
            assert re.search(rf"^{policy}\s+{chunks}\s+[\d,]+\s+[\d,]+\s+[\d.]+x", out, re.M), out
    assert "DECISIONS DIFFER" not in out
    assert re.search(r"evicted", out) and out.count("load average") == 2
    mix = re.search(r"\(lru, 300 chunks\): [\d,]+ ops .* ([\d,]+) evicted", out)
    assert mix is not None and int(mix.group(1).replace(",", "")) > 0, out


def test_bench_offload_index_served_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """``--served``: the third engine (the index on a child server) decides as the
    others on the whole stream, and its row carries its ratio and the server's CPU."""
    argv = ["--chunks", "300", "--rounds", "2", "--requests", "40", "--policies", "arc", "--served"]
    assert bench_offload_index.main(argv) == 0
    out = capsys.readouterr().out
    assert "one OffloadStep per 16 requests" in out, out
    row = r"^arc\s+300(\s+[\d,]+){2}\s+[\d.]+x\s+\S+\s+[\d,]+\s+[\d.]+x\s+\S+\s+[\d.]+$"
    assert re.search(row, out, re.M), out
    assert "DECISIONS DIFFER" not in out
