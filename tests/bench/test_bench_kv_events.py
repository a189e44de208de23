"""benchmarks/bench_kv_events.py runs end to end in a tiny configuration (its figures
are quoted in notes): every mode's row is printed and the ZMQ subscriber process
decoded every event the timed run published. Never a timing."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_kv_events


def test_bench_kv_events_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_kv_events.main(["--steps", "8", "--rounds", "1", "--num-blocks", "512"]) == 0
    out = capsys.readouterr().out
    for mode in bench_kv_events.MODES:
        assert re.search(rf"^\s*{mode} ", out, re.MULTILINE), out
    decoded = re.search(r"decoded (\d+) of (\d+) events, (\d+) batches", out)
    assert decoded is not None, out
    assert decoded.group(1) == decoded.group(2) != "0"
