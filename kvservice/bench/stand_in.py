"""A stand-in for a server on the client's machine: a child process that, on request,
reads what it is sent, spends a given CPU time writing through memory of its own while
the caller waits, and answers with as many bytes as asked.

What waiting on a server costs the waiting thread beyond the wait itself (it sleeps,
another process runs on the CPUs and in the caches, and it wakes cold) can then be
measured in-process: the same work with and without a stand-in's turn in between.
"""

from __future__ import annotations

import subprocess
import sys

# The child: a line in (seconds of CPU, the request's bytes, the answer's bytes), then
# the request, read as a server reads its step; once the CPU is spent, the answer and a
# last line. It writes a byte every cache line and page apart, through a buffer larger
# than a core's caches.
_CHILD = """
import sys, time
memory = bytearray(int(sys.argv[1]))
stride = 4096 + 64
index = 0
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
while line := stdin.readline():
    seconds, request_bytes, answer_bytes = line.split()
    stdin.read(int(request_bytes))
    until = time.thread_time() + float(seconds)
    while time.thread_time() < until:
        for _ in range(256):
            memory[index] = 1
            index = (index + stride) % len(memory)
    stdout.write(bytes(int(answer_bytes)) + b"done\\n")
    stdout.flush()
"""

DEFAULT_MEMORY_BYTES = 8 << 20
_DONE = b"done\n"


class StandIn:
    """The child process; ``run(seconds)`` returns once it has spent that CPU time.
    ``close`` ends it (``contextlib.closing``)."""

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    @property
    def pid(self) -> int:
        return self._child.pid

    def run(self, seconds: float, request: bytes = b"", answer_bytes: int = 0) -> bytes:
        """Send the child ``request``, let it spend ``seconds`` of CPU, and wait for its
        answer of ``answer_bytes`` (zeros), as a server's client waits for a step's."""
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(b"%r %d %d\n" % (seconds, len(request), answer_bytes) + request)
        self._child.stdin.flush()
        answer = self._child.stdout.read(answer_bytes + len(_DONE))
        if answer[answer_bytes:] != _DONE:
            raise RuntimeError(f"the stand-in process ended (exit status {self._child.poll()})")
        return answer[:answer_bytes]

    def close(self) -> None:
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._child.wait(timeout=30)
        if self._child.stdout is not None:
            self._child.stdout.close()
