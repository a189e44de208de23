"""The CPU-side parts of ``benchmarks/gpu_check.sh``: argument parsing and the skip
where there is no CUDA (its stages run only on a GPU machine, or with
``--cpu-dry-run``, which is too slow for the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown argument: --bogus"),
        (["--out"], "--out needs a folder"),
        (["--python"], "--python needs an interpreter"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    result = run_script(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_help_lists_the_options() -> None:
    result = run_script("--help")
    assert result.returncode == 0
    for option in ("--out", "--python", "--quick", "--cpu-dry-run"):
        assert option in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_without_cuda_it_skips_and_says_why(tmp_path: Path) -> None:
    result = run_script("--out", str(tmp_path), "--python", sys.executable)
    assert result.returncode == 3
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("SKIPPED: no CUDA device visible")
    assert not (tmp_path / "cuda_tests.log").exists()  # no stage ran


def test_an_interpreter_without_torch_is_reported(tmp_path: Path) -> None:
    result = run_script("--out", str(tmp_path), "--python", str(tmp_path / "missing-python"))
    assert result.returncode == 3
    assert "cannot import torch" in (tmp_path / "summary.txt").read_text()
