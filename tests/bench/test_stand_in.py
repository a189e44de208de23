"""The stand-in server spends CPU of its own when asked, and only then."""

from __future__ import annotations

import time
from contextlib import closing

import pytest

from kvservice.bench.measure import process_cpu_seconds
from kvservice.bench.stand_in import StandIn


def test_the_stand_in_spends_cpu_in_its_own_process_while_the_caller_waits() -> None:
    with closing(StandIn(memory_bytes=1 << 20)) as stand_in:
        stand_in.run(0.0)  # started and answering
        before = process_cpu_seconds(stand_in.pid)
        caller_before = time.thread_time()
        stand_in.run(0.05)
        caller_cpu = time.thread_time() - caller_before
        after = process_cpu_seconds(stand_in.pid)
        pid = stand_in.pid
    if before is None or after is None:
        pytest.skip("no /proc to read another process's CPU from")
    # It returns only once the child has spent what was asked (its own clock).
    assert after - before >= 0.05
    # The caller only waited: its own CPU is a small part of the child's.
    assert caller_cpu < (after - before) / 2
    assert process_cpu_seconds(pid) is None  # closed: the child is gone


def test_the_stand_in_reads_a_request_and_answers_with_the_bytes_asked_for() -> None:
    with closing(StandIn(memory_bytes=1 << 20)) as stand_in:
        # Larger than a pipe's buffer: the child reads while the caller writes.
        assert stand_in.run(0.0, b"\x01" * 200_000, 1000) == bytes(1000)
        assert stand_in.run(0.0, b"\n\n", 0) == b""  # a request's bytes are not lines
        assert stand_in.run(0.001) == b""
