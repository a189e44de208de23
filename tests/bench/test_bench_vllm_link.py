"""``benchmarks/bench_vllm_link.py`` runs end to end in its smallest configuration (its
figures are quoted in the README): a row per mode, the remote ones on a real server's
step socket. Never a timing."""

from __future__ import annotations

import os
import re

import pytest

from benchmarks import bench_vllm_link


@pytest.fixture(autouse=True)
def _restore_kvservice_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The benchmark sets the connection variables for each mode and restores them.
    for name in ("KVSERVICE_TARGET", "KVSERVICE_STEP_SOCKET", "KVSERVICE_CLIENT_BLOCK_HASHES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSERVICE_CONFIRM", "sync")


def test_bench_vllm_link_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "8", "--churn", "2", "--steps", "20", "--rounds", "1"]
    bench_vllm_link.main([*argv, "--settle-ms", "0.1"])
    out = capsys.readouterr().out
    cell = r" +(\d+\.\d+) \(\+-?\d+\.\d+\)"
    for mode in bench_vllm_link.MODES:
        row = re.search(rf"^{re.escape(mode)}{cell * 4}$", out, re.M)
        assert row is not None, out
        decode, admission, free, flush = map(float, row.groups())
        assert decode > 0 and admission > 0 and free > 0
        assert flush > 0
    assert "KVSERVICE_TARGET" not in os.environ


def test_bench_vllm_link_in_scheduler_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench_vllm_link.main(["--in-scheduler", "--steps", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    # vLLM's scheduler admits, allocates and flushes every step, in every mode.
    for method in ("allocate_slots", "get_computed_blocks", "take_kv_cache_block_copies"):
        row = re.search(rf"^{method} +(\d+\.\d) +(\d+\.\d+) +(\d+\.\d+) +[-+]", out, re.M)
        assert row is not None, out
        calls, in_process, remote = map(float, row.groups())
        assert calls >= 1 and in_process > 0 and remote > 0
    for mode in (
        bench_vllm_link.REMOTE,
        bench_vllm_link.MINIMAL_LINK,
        bench_vllm_link.PASS_THROUGH,
    ):
        assert re.search(rf"^  {re.escape(mode)}: [-+]\d+\.\d+ ms a step, of which", out, re.M)
    assert "KVSERVICE_TARGET" not in os.environ
