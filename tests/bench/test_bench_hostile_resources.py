"""``benchmarks/bench_hostile_resources.py`` runs end to end at its smoke size: every
shape against its own ``kvservice serve`` child, each refused by the limit it aims at
after exactly what that limit allows, and the server's log read. Its figures are
quoted in notes, so it must keep working as the code under it changes; no timing or
memory figure is checked."""

from __future__ import annotations

import math
import re

import pytest

from benchmarks import bench_hostile_resources as bench


def _row(out: str, shape: str) -> list[str]:
    """The table row of ``shape``: its cells after the name, split on blanks."""
    (line,) = (line for line in out.splitlines() if re.match(rf"{re.escape(shape)}\s{{2,}}", line))
    return line[len(shape) :].split()


def test_quick_run_reaches_every_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    limits = bench.QUICK_LIMITS
    per_prompt = limits["max_mm_items_per_prompt"]
    session_tenants = math.ceil(limits["max_sessions"] / limits["max_sessions_per_tenant"]) + 1
    stream_tenants = (
        math.ceil(limits["max_step_streams"] / limits["max_step_streams_per_tenant"]) + 1
    )
    expected = {
        "mm_ids": (
            limits["max_mm_identifier_bytes_per_tenant"]
            // (per_prompt * limits["max_mm_identifier_length"]),
            "max_mm_identifier_bytes_per_tenant",
        ),
        "mm_items": (limits["max_mm_items_per_tenant"] // per_prompt, "max_mm_items_per_tenant"),
        "sessions, 1 tenant": (limits["max_sessions_per_tenant"], "max_sessions_per_tenant"),
        f"sessions, {session_tenants} tenants": (limits["max_sessions"], "max_sessions"),
        "streams, 1 tenant": (
            limits["max_step_streams_per_tenant"],
            "max_step_streams_per_tenant",
        ),
        f"streams, {stream_tenants} tenants": (limits["max_step_streams"], "max_step_streams"),
        "session churn": (bench.QUICK_CHURN, "-"),
    }
    for shape, (accepted, refused_by) in expected.items():
        cells = _row(out, shape)
        assert cells[:2] == [f"{accepted:,}", refused_by], (shape, cells)
        # The log lines the server wrote during the row (the next-to-last cell): every
        # shape makes it write some, so the log was found and read.
        assert int(cells[-2].replace(",", "")) > 0, (shape, cells)
