"""``kvservice.bench.process_sampler`` finds where another process spends its CPU:
a child that spins in a known function is sampled there, and one that sleeps is
hardly sampled at all (py-spy skips idle threads)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from kvservice.bench.process_sampler import SamplerUnavailableError, natively_sampled, sampled

SPINNER = """
import time
def spin_in_a_known_function():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sum(range(1000))
print("ready", flush=True)
spin_in_a_known_function()
"""

SLEEPER = """
import time
print("ready", flush=True)
time.sleep(60)
"""


def child(source: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[str]]:
    yield from child(SPINNER)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[str]]:
    yield from child(SLEEPER)


def sample_for(pid: int, seconds: float) -> dict[str, int]:
    try:
        with sampled(pid, rate_hz=200) as samples:
            time.sleep(seconds)
    except SamplerUnavailableError as error:
        pytest.skip(f"py-spy cannot sample here: {error}")
    return dict(samples.leaves)


def test_a_busy_process_is_sampled_in_its_function(spinner: subprocess.Popen[str]) -> None:
    leaves = sample_for(spinner.pid, 1.0)
    total = sum(leaves.values())
    in_spin = sum(n for leaf, n in leaves.items() if leaf.startswith("spin_in_a_known_function"))
    # About 200 samples a second of one busy thread.
    assert total >= 50, leaves
    assert in_spin / total > 0.9, leaves


def test_an_idle_process_is_hardly_sampled(
    spinner: subprocess.Popen[str], sleeper: subprocess.Popen[str]
) -> None:
    busy = sum(sample_for(spinner.pid, 1.0).values())
    idle = sum(sample_for(sleeper.pid, 1.0).values())
    assert idle < busy / 10, (idle, busy)


NATIVE_SPINNER = """
import hashlib, time
def hash_in_a_known_function():
    data = bytes(1 << 20)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        hashlib.sha256(data).digest()
print("ready", flush=True)
hash_in_a_known_function()
"""


def test_a_native_sample_holds_the_c_frames_under_the_python_ones() -> None:
    """Sampled natively, a child hashing a megabyte at a time is sampled in the C code
    its Python function calls (OpenSSL's, outside the interpreter, whose own frames
    py-spy leaves out), below that function's frame."""
    for process in child(NATIVE_SPINNER):
        try:
            with natively_sampled(process.pid, rate_hz=200) as samples:
                time.sleep(1.0)
        except SamplerUnavailableError as error:
            pytest.skip(f"py-spy cannot sample natively here: {error}")
    below = Counter[str]()
    for stack, count in samples.stacks.items():
        frames = [frame.split(" (", 1)[0] for frame in stack]
        if "hash_in_a_known_function" in frames[:-1]:
            below[frames[-1]] += count
    assert sum(below.values()) > 0.5 * samples.total, (below, samples.stacks)
