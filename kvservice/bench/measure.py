"""What every benchmark of the repo measures with, so that ``kvservice bench`` and
the scripts in ``benchmarks/`` count alike: a process's CPU time read from the OS, a
meter of one section's wall and CPU time, the rotating order of rounds, and ratios
taken within a round.

On a shared machine other processes stretch the wall clock but hardly the CPU time
of the processes measured, so the CPU figures are the steadier ones; and a ratio is
only ever taken between two measurements of the same round, which the same noise
hit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def process_cpu_seconds(pid: int) -> float | None:
    """CPU time of every thread of a process so far, at nanosecond resolution
    (``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` counts 10 ms ticks); None
    where /proc is not."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total_ns = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as stat:
                total_ns += int(stat.read().split()[0])
        except OSError:
            continue  # the thread ended meanwhile
    return total_ns / 1e9


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed section: its operations, the wall time, and the CPU time this
    process and the server spent on it."""

    ops: int
    wall_s: float
    cpu_s: float

    @property
    def ops_s(self) -> float:
        return self.ops / self.wall_s

    @property
    def cpu_us_per_op(self) -> float:
        return self.cpu_s / self.ops * 1e6


class Meter:
    """Times a section: wall clock, this process's CPU, and the server's CPU (when
    its pid is known)."""

    def __init__(self, server_pid: int | None = None) -> None:
        self._server_pid = server_pid
        self._start = (0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float]:
        server = 0.0
        if self._server_pid is not None:
            server = process_cpu_seconds(self._server_pid) or 0.0
        return time.perf_counter(), process_cpu_seconds(os.getpid()) or 0.0, server

    def start(self) -> None:
        self._start = self._now()

    def stop(self, ops: int) -> Sample:
        wall, cpu, server = (b - a for a, b in zip(self._start, self._now(), strict=True))
        return Sample(ops, wall, cpu + server)


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: each round starts one item later, so none
    always runs first (or last)."""
    shift = round_index % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def median_ratio(values: Sequence[float], baselines: Sequence[float]) -> float:
    """The median over rounds of ``value / baseline`` within each round."""
    return statistics.median(v / b for v, b in zip(values, baselines, strict=True))


def layer_names(
    parser: argparse.ArgumentParser, chosen: str, known: Sequence[str], base: str = "core"
) -> list[str]:
    """The ``--layers`` a ``*_layers`` benchmark runs (comma-separated): ``base`` first,
    always, as the ratios' base; an unknown name is the parser's usage error."""
    names = [base, *(n for n in chosen.split(",") if n != base)]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown layers {unknown}; choose from {', '.join(known)}")
    return names


def time_layers(
    build: Callable[[str], Callable[[], object]], names: Sequence[str], rounds: int, units: int
) -> dict[str, list[float]]:
    """The ``*_layers`` benchmarks' rounds: each round builds every layer's run afresh
    (``build(name)``, untimed), then times the runs in that round's rotated order; per
    layer, the microseconds per unit (``units`` a run) of each round."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        runs = {name: build(name) for name in names}
        for name in rotated(names, round_index):
            start = time.perf_counter()
            runs[name]()
            samples[name].append((time.perf_counter() - start) / units * 1e6)
    return samples


def print_layers(samples: dict[str, list[float]], unit: str, base: str = "core") -> None:
    """Each layer's median per unit, its lowest and highest round, and its ratio to
    ``base`` within each round (median over rounds)."""
    print(f"{'layer':>12} {unit:>11} {'per round':>16} {'vs ' + base:>8}")
    for name, values in samples.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(
            f"{name:>12} {statistics.median(values):>11.2f} {spread:>16} "
            f"{median_ratio(values, samples[base]):>7.2f}x"
        )


def ratio_columns(ratios: Sequence[float]) -> str:
    """The median of per-round ratios and their spread (lowest-highest), as two columns
    of the benchmarks' tables (8 and 13 characters wide)."""
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    return f"{statistics.median(ratios):>7.2f}x{spread:>13}"


def machine_load() -> str:
    """The machine's CPUs and load average, for a benchmark's first and last line."""
    one, five, fifteen = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min)"
