"""Where another process spends its CPU, native frames included: Linux ``perf``
samples it while a block runs, with each sample's whole call stack (DWARF unwinding).

``process_sampler`` (py-spy) sees Python frames only, so a function that mypyc
compiled counts at the Python line that called it, and py-spy's native mode pauses
the process at every sample, stretching a step several times. ``perf`` reads the
stack without stopping the process and names the compiled functions (mypyc's
``CPyDef_<module>___<function>``) and the interpreter's own (``_PyEval_EvalFrameDefault``
for a Python frame, ``_PyObject_Malloc``, ...), though not which Python function an
interpreted frame runs.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.bench.process_sampler import SamplerUnavailableError, recording

# perf opens the process's maps and starts its buffers before the first sample.
_ATTACH_S = 0.5
# Bytes of stack copied at each sample for unwinding: deep enough for an asyncio
# server's frames under uvloop.
_STACK_BYTES = 32768

Stack = tuple[str, ...]
"""A sample's functions, innermost first."""


@dataclass
class NativeSamples:
    """The samples of one sampled block: stack -> samples taken in it."""

    stacks: Counter[Stack] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.stacks.values())


def perf() -> str:
    found = shutil.which("perf")
    if found is None:
        raise SamplerUnavailableError("perf is not installed (Debian: linux-perf)")
    return found


@contextlib.contextmanager
def native_sampled(pid: int, rate_hz: int = 999) -> Iterator[NativeSamples]:
    """Sample process ``pid`` (the CPU clock, ``rate_hz`` times a CPU second) while
    the block runs; the ``NativeSamples`` yielded are filled when it ends."""
    samples = NativeSamples()
    with tempfile.TemporaryDirectory(prefix="kvservice-perf-") as directory:
        data = Path(directory, "perf.data")
        command = [perf(), "record", "--quiet", "-e", "cpu-clock", "-F", str(rate_hz)]
        command += ["--call-graph", f"dwarf,{_STACK_BYTES}", "-p", str(pid), "-o", str(data)]
        with recording(command, _ATTACH_S, data):
            yield samples
        script = subprocess.run(
            [perf(), "script", "-F", "ip,sym", "-i", str(data)],
            capture_output=True,
            text=True,
            check=True,
        )
        samples.stacks.update(parse_script(script.stdout))


def parse_script(text: str) -> Counter[Stack]:
    """``perf script -F ip,sym``: a sample is its frames, one a line (address, then
    the function, or ``[unknown]``), innermost first, and a blank line ends it."""
    stacks: Counter[Stack] = Counter()
    frames: list[str] = []
    for line in text.splitlines():
        address, _, function = line.strip().partition(" ")
        if address:
            frames.append(function or "[unknown]")
        elif frames:
            stacks[tuple(frames)] += 1
            frames = []
    if frames:
        stacks[tuple(frames)] += 1
    return stacks


def compiled_name(function: str) -> str | None:
    """The ``module.function`` a mypyc function symbol stands for, or None for
    another symbol: ``CPyDef_table___RequestTable____allocate`` ->
    ``table.RequestTable._allocate``."""
    if not function.startswith("CPyDef_"):
        return None
    module, _, rest = function.removeprefix("CPyDef_").partition("___")
    return f"{module}.{rest.replace('___', '.')}" if rest else module


INTERPRETER_FRAME = "_PyEval_EvalFrameDefault"
"""The interpreter's function that runs a Python frame."""


def interpreted_under(stack: Stack, outer: int) -> str | None:
    """For a sample inside the compiled frame ``stack[outer]``: when it was taken in
    Python code that compiled code called, the compiled function that called the
    outermost such Python frame (``module.function``; ``?`` when unwinding lost it),
    else None."""
    inner = stack[:outer]
    python = [i for i, function in enumerate(inner) if function.startswith(INTERPRETER_FRAME)]
    if not python:
        return None
    for function in inner[python[-1] :]:
        name = compiled_name(function)
        if name is not None:
            return name
    return "?"
