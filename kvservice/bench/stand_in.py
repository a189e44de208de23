"""A stand-in for a server on the client's machine: a child process that, on request,
spends a given CPU time writing through memory of its own, while the caller waits.

What waiting on a server costs the waiting thread beyond the wait itself (it sleeps,
another process runs on the CPUs and in the caches, and it wakes cold) can then be
measured in-process: the same work with and without a stand-in's turn in between.
"""

from __future__ import annotations

import subprocess
import sys

# The child: one line in (seconds of CPU), one line out once spent. It writes a byte
# every cache line and page apart, through a buffer larger than a core's caches.
_CHILD = """
import sys, time
memory = bytearray(int(sys.argv[1]))
stride = 4096 + 64
index = 0
for line in sys.stdin:
    until = time.thread_time() + float(line)
    while time.thread_time() < until:
        for _ in range(256):
            memory[index] = 1
            index = (index + stride) % len(memory)
    sys.stdout.write("done\\n")
    sys.stdout.flush()
"""

DEFAULT_MEMORY_BYTES = 8 << 20


class StandIn:
    """The child process; ``run(seconds)`` returns once it has spent that CPU time.
    ``close`` ends it (``contextlib.closing``)."""

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    @property
    def pid(self) -> int:
        return self._child.pid

    def run(self, seconds: float) -> None:
        """Let the child spend ``seconds`` of CPU; wait until it has."""
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(f"{seconds!r}\n")
        self._child.stdin.flush()
        if self._child.stdout.readline() != "done\n":
            raise RuntimeError(f"the stand-in process ended (exit status {self._child.poll()})")

    def close(self) -> None:
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._child.wait(timeout=30)
        if self._child.stdout is not None:
            self._child.stdout.close()
