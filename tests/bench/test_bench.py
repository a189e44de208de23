"""``kvservice bench`` and ``kvservice demo`` end to end: real child servers on
loopback ports, the smoke sizes, every output format, and bad flags refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvservice.bench.runner import MODES
from kvservice.bench.server import ServerStartError, child_server
from kvservice.cli import build_parser, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["bench", "--smoke", "--json", "--no-progress", *flags]) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


def test_smoke_compares_every_mode_on_the_same_decisions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = bench_json(capsys)
    (pool,) = document["pools"]
    rows = {row["mode"]: row for row in pool["modes"]}
    assert list(rows) == list(MODES)
    assert all(row["decisions_match"] for row in rows.values())
    # The smoke pool is small enough to preempt, and the shared prompt hits.
    assert pool["preemptions"] > 0
    assert 0 < pool["prefix_hit_rate"] < 1
    assert 0 < pool["peak_usage"] <= 1
    assert rows["in-process"]["vs_in_process"] == pytest.approx(1.0)
    rounds = document["config"]["rounds"]
    assert rows["in-process"]["vs_in_process_rounds"] == pytest.approx([1.0] * rounds)
    for row in rows.values():
        # One ratio per round, each from that round's own times.
        ratios = row["vs_in_process_rounds"]
        assert len(ratios) == rounds and all(r > 0 for r in ratios)
        assert min(ratios) <= row["vs_in_process"] * (1 + 1e-9)
        assert max(ratios) >= row["vs_in_process"] * (1 - 1e-9)
    for row in rows.values():
        assert row["steps"] == pool["steps"] > 0
        assert row["steps_per_s"] > 0
        assert row["p50_ms"] <= row["p99_ms"]
        # A step splits into time inside the backend and the scheduler's own; each
        # part of a step is at most the whole step, so each quantile is too.
        for part in ("backend", "scheduler"):
            assert 0 < row[f"{part}_p50_ms"] <= row[f"{part}_p99_ms"] <= row["p99_ms"]
            assert row[f"{part}_p50_ms"] <= row["p50_ms"]
    # Batching: a handful of messages per step against one RPC per operation.
    for mode in ("step", "stream"):
        assert 1 <= rows[mode]["messages_per_step"] < pool["ops_per_step"]
    assert rows["unary"]["messages_per_step"] is None


def test_system_prompts_at_a_priority_decide_alike_in_every_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pool with the priority policy and the workload's system prompts kept at 80:
    every mode (the replicated ones through a replica session) decides as in-process."""
    document = bench_json(capsys, "--eviction-policy", "priority", "--system-prompt-priority", "80")
    assert document["config"]["eviction_policy"] == "priority"
    (pool,) = document["pools"]
    assert all(row["decisions_match"] for row in pool["modes"])


def test_pools_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    document = bench_json(capsys, "--modes", "in-process", "--num-blocks", "96,400")
    small, large = document["pools"]
    assert (small["num_blocks"], large["num_blocks"]) == (96, 400)
    # The larger pool holds everything: nothing is preempted there.
    assert small["preemptions"] > 0 == large["preemptions"]
    assert large["modes"][0]["vs_first_pool"] > 0
    assert small["modes"][0]["vs_first_pool"] is None


def test_table_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    flags = ["bench", "--smoke", "--no-progress", "--modes", "in-process,stream"]
    assert main([*flags, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "steps/s" in out and "vs in-proc" in out
    assert [line.split()[1] for line in out.splitlines() if line.strip().startswith("96 ")] == [
        "in-process",
        "stream",
    ]
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_help_explains_every_option() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = commands.choices["bench"]
    text = bench.format_help()
    for action in bench._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help, f"{action.option_strings} has no help"
    for mode in MODES:
        assert mode in text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--modes", "in-process,bogus"], "bogus"),
        (["--modes", "step,step"], "step,step"),
        (["--num-blocks", "1"], "got 1"),
        (["--num-blocks", "ten"], "'ten'"),
        (["--steps", "0"], "'0'"),
        (["--workload", "chess"], "chess"),
    ],
)
def test_bad_flags_are_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--system-prompt-priority", "80"], "needs --eviction-policy priority"),
        (["--eviction-policy", "priority", "--system-prompt-priority", "101"], "[0, 100]"),
    ],
)
def test_retention_flags_are_checked_first(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    assert main(["bench", "--smoke", "--no-progress", *flags]) == 2
    assert named in capsys.readouterr().err


def test_target_takes_one_pool(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--target", "127.0.0.1:1", "--num-blocks", "96,200"])
    assert code == 2
    assert "--num-blocks" in capsys.readouterr().err


def test_bench_against_a_running_server(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--num-blocks=128", "--max-model-len=1024"]
    with child_server(flags) as server:
        document = bench_json(capsys, "--target", server.target, "--modes", "in-process,step")
    (pool,) = document["pools"]
    assert pool["num_blocks"] == 128  # the target's pool, not the smoke default
    assert all(row["decisions_match"] for row in pool["modes"])


def test_a_server_that_cannot_start_is_reported() -> None:
    # 2 blocks cannot hold one max_model_len sequence: the server refuses to start.
    with pytest.raises(ServerStartError, match="blocks"), child_server(["--num-blocks=2"]):
        pass


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "ran 64 requests" in out
    assert "preemptions: " in out and "cached blocks evicted: " in out
    assert "runtime on cpu" in out
    assert "http://127.0.0.1:" in out
    numbers = {
        line.split(":")[0]: line for line in out.splitlines() if line.startswith("preemptions")
    }
    # The scheduler's count and the server's metric agree.
    preempted = numbers["preemptions"].split()[1]
    assert f"server counted {preempted})" in numbers["preemptions"]
    assert preempted != "0"
