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
