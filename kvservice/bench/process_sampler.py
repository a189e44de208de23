"""Where another process spends its CPU: py-spy samples it while a block runs, and
the samples are counted by the frame each was taken in (its innermost Python frame).

For a benchmark whose work happens in a child process (a kvservice server): the
client side is sampled in-process (pyinstrument), the server with this. A function
that mypyc compiled is no Python frame, so its samples count at the line of the
Python function that called it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# py-spy attaches (reads the process's memory layout) before its first sample.
_ATTACH_S = 1.0
_STOP_TIMEOUT_S = 30.0


class SamplerUnavailableError(RuntimeError):
    """py-spy is not installed, or may not read the process (ptrace permission)."""


@dataclass
class Samples:
    """The samples of one sampled block: innermost frame ("function (file:line)",
    the file relative to the interpreter's path) -> samples taken there."""

    leaves: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.leaves.values())


def py_spy() -> str:
    """The py-spy beside this interpreter (a venv's), or on PATH."""
    found = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if found is None:
        raise SamplerUnavailableError(
            "py-spy is not installed (pip install -e '.[dev]' installs it)"
        )
    return found


@contextlib.contextmanager
def sampled(pid: int, rate_hz: int = 1000) -> Iterator[Samples]:
    """Sample process ``pid`` (its busy threads, ``rate_hz`` times a second) while
    the block runs; the ``Samples`` yielded are filled when it ends."""
    samples = Samples()
    with tempfile.TemporaryDirectory(prefix="kvservice-sampler-") as directory:
        output = Path(directory, "samples.txt")
        command = [py_spy(), "record", "--pid", str(pid), "--rate", str(rate_hz)]
        command += ["--format", "raw", "--output", str(output), "--nonblocking"]
        with recording(command, _ATTACH_S, output):
            yield samples
        samples.leaves.update(_leaves(output.read_text(encoding="utf-8")))


@dataclass
class StackSamples:
    """The samples of one sampled block by their whole stack: frames outermost first,
    Python frames as "function (file:line)" and, sampled natively, C and compiled
    frames as "symbol (where)" -> samples taken in that stack."""

    stacks: Counter[tuple[str, ...]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.stacks.values())


@contextlib.contextmanager
def natively_sampled(pid: int, rate_hz: int = 400) -> Iterator[StackSamples]:
    """Sample process ``pid`` with its native frames (the C and mypyc-compiled code
    under each Python frame) while the block runs. py-spy stops the process to unwind
    each sample, which stretches what it samples: the shares of the samples count,
    not their speed. It may sample the process that calls it."""
    samples = StackSamples()
    with tempfile.TemporaryDirectory(prefix="kvservice-sampler-") as directory:
        output = Path(directory, "samples.txt")
        command = [py_spy(), "record", "--pid", str(pid), "--rate", str(rate_hz), "--native"]
        command += ["--format", "raw", "--output", str(output)]
        with recording(command, _ATTACH_S, output):
            yield samples
        samples.stacks.update(_stacks(output.read_text(encoding="utf-8")))


@contextlib.contextmanager
def recording(command: list[str], attach_s: float, output: Path) -> Iterator[None]:
    """Run the sampler ``command`` while the block runs; it has ``attach_s`` to attach
    and is stopped as Control-C stops it (SIGINT: py-spy and perf write their samples
    to ``output`` then). ``SamplerUnavailableError`` with what it said when it exits
    early or writes nothing."""
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(attach_s)
    if sampler.poll() is not None:
        raise SamplerUnavailableError(_failure(sampler, Path(command[0]).name))
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGINT)
        try:
            sampler.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sampler.kill()
            raise
    if not output.exists():
        raise SamplerUnavailableError(_failure(sampler, Path(command[0]).name))


def _failure(sampler: subprocess.Popen[bytes], tool: str) -> str:
    assert sampler.stderr is not None
    said = sampler.stderr.read().decode(errors="replace").strip()
    return f"{tool} could not sample the process (exit {sampler.returncode}): {said}"


def _stacks(raw: str) -> Counter[tuple[str, ...]]:
    """py-spy's raw format: one stack a line, outermost first, frames joined by ";",
    then a space and the samples taken in that stack."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def _leaves(raw: str) -> Counter[str]:
    """The samples of py-spy's raw format by their innermost frame."""
    leaves: Counter[str] = Counter()
    for stack, count in _stacks(raw).items():
        leaves[stack[-1]] += count
    return leaves
