"""``kvservice.bench.native_sampler`` reads where another process spends its CPU
natively: perf's stacks are parsed as perf prints them, mypyc's symbols are named as
the functions they compile, Python called from compiled code is told apart, and a
child that spins in Python is sampled in the interpreter (where perf may run)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvservice.bench.native_sampler import (
    compiled_name,
    interpreted_under,
    native_sampled,
    parse_script,
)
from kvservice.bench.process_sampler import SamplerUnavailableError

# What ``perf script -F ip,sym`` prints: two samples, the second twice, innermost first.
SCRIPT = """
\t          1a2b3c _PyObject_Malloc
\t          4d5e6f CPyDef_table___RequestTable____allocate
\t          778899 [unknown]

\t          1a2b3c CPyDef_types___Allocation
\t          4d5e6f CPyDef_operations___allocate_slots_batch_gen_____mypyc_generator_helper__

\t          1a2b3c CPyDef_types___Allocation
\t          4d5e6f CPyDef_operations___allocate_slots_batch_gen_____mypyc_generator_helper__
"""


def test_perf_script_is_read_as_stacks_innermost_first() -> None:
    stacks = parse_script(SCRIPT)
    assert stacks == {
        ("_PyObject_Malloc", "CPyDef_table___RequestTable____allocate", "[unknown]"): 1,
        (
            "CPyDef_types___Allocation",
            "CPyDef_operations___allocate_slots_batch_gen_____mypyc_generator_helper__",
        ): 2,
    }


def test_mypyc_symbols_are_named_as_the_functions_they_compile() -> None:
    assert compiled_name("CPyDef_table___RequestTable____allocate") == (
        "table.RequestTable._allocate"
    )
    assert compiled_name("CPyDef_converters___new_requests_from_batch") == (
        "converters.new_requests_from_batch"
    )
    assert compiled_name("_PyEval_EvalFrameDefault") is None


def test_python_called_from_compiled_code_is_named_by_its_compiled_caller() -> None:
    stack = (
        "_PyObject_Malloc",
        "_PyEval_EvalFrameDefault",
        "_PyEval_Vector",
        "_PyEval_EvalFrameDefault",
        "PyObject_Vectorcall",
        "CPyDef_converters___new_requests_from_batch",
        "CPyDef_step____run_StepRunner_gen_____mypyc_generator_helper__",
        "_PyEval_EvalFrameDefault",  # the servicer, outside the runner
    )
    assert interpreted_under(stack, 6) == "converters.new_requests_from_batch"
    # Compiled code only, inside the runner: nothing interpreted.
    assert interpreted_under(stack[5:], 1) is None
    # Python with no compiled frame left between it and the runner (unwinding lost it).
    assert interpreted_under(("_PyEval_EvalFrameDefault", "[unknown]", "x"), 2) == "?"


SPINNER = """
import time
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    sum(range(1000))
"""


def test_a_process_spinning_in_python_is_sampled_in_the_interpreter() -> None:
    process = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        try:
            with native_sampled(process.pid, rate_hz=200) as samples:
                time.sleep(1.0)
        except SamplerUnavailableError as error:
            pytest.skip(f"perf cannot sample here: {error}")
    finally:
        process.kill()
        process.wait()
    # About 200 samples a second of one busy thread, nearly all running Python.
    assert samples.total >= 50, samples.stacks
    in_python = sum(
        count
        for stack, count in samples.stacks.items()
        if any(f.startswith("_PyEval_EvalFrameDefault") for f in stack)
    )
    assert in_python / samples.total > 0.8, samples.stacks.most_common(5)
