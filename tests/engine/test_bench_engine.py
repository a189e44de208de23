"""``benchmarks/bench_vllm_engine.py`` runs end to end in its smallest configuration, and
a run that generated other tokens than stock vLLM stops it. Never a timing."""

from __future__ import annotations

import pytest

from benchmarks import bench_vllm_engine
from kvservice.integrations.vllm.engine_driver import EngineRun, RequestResult


def test_bench_vllm_engine_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """One round of a few short requests in every mode, with its own server. Torch's
    threads are left as they are: the test process's other engines share them."""
    assert bench_vllm_engine.main(["--quick", "--threads", "0"]) == 0
    out = capsys.readouterr().out
    for mode in bench_vllm_engine.modes():
        assert f"\n{mode.name} " in out
    assert "tokens: every mode generated stock vLLM's in every round" in out


def _run(*tokens: tuple[int, ...], preemptions: int = 0) -> EngineRun:
    requests = {f"req-{i}": RequestResult(ids, None, "length") for i, ids in enumerate(tokens)}
    return EngineRun(requests=requests, preemptions=preemptions)


def test_other_tokens_than_stock_stop_the_benchmark() -> None:
    stock = _run((5, 6), (7, 8))
    check, differ = bench_vllm_engine.check_outcome, bench_vllm_engine.TokensDifferError
    check(stock, _run((5, 6), (7, 8)), "same", 0)
    with pytest.raises(differ, match=r"(?s)round 2: other .*\n  req-1: stock .*\(7, 9\)"):
        check(stock, _run((5, 6), (7, 9)), "other", 1)
    with pytest.raises(differ, match="preemptions: stock 0, x 1"):
        check(stock, _run((5, 6), (7, 8), preemptions=1), "x", 0)
