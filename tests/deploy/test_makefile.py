"""The Makefile's two installs, by what GNU make would run (``make -n``) in a copy of
the files it reads, with the stamps' times set as each earlier command leaves them:
`make serve` installs the project and its runtime dependencies only (no dev tools, no
torch, no vLLM), `make test` adds them, and neither undoes the other."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.support import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

SERVE_STAMP = ".venv/.installed-serve"
TEST_STAMP = ".venv/.installed"


def tree(tmp_path: Path) -> Path:
    """The files the Makefile's install rules depend on, an hour old."""
    for name in ("Makefile", "pyproject.toml", "setup.py", "requirements/vllm-test.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
        age(tmp_path / name, 3600)
    return tmp_path


def age(path: Path, seconds: float) -> None:
    then = path.stat().st_mtime - seconds if path.exists() else 0
    os.utime(path, (then, then))


def stamp(root: Path, *names: str) -> None:
    """As a finished install leaves them: newer than what they depend on."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()


def planned(root: Path, target: str) -> list[str]:
    """The install commands ``make <target>`` would run (not counting the compiled
    core's check, which reinstalls the project alone only when it is stale)."""
    done = subprocess.run(
        ["make", "-n", target], cwd=root, capture_output=True, text=True, check=True, timeout=60
    )
    commands = done.stdout.replace("\\\n", " ").splitlines()  # continuation lines joined
    return [line for line in commands if "pip install" in line and "compiled.py" not in line]


def test_serve_on_a_fresh_machine_installs_only_the_runtime(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (install,) = planned(root, "serve")
    assert install.rstrip().endswith(" -e .")
    assert "dev" not in install and "runtime" not in install


def test_test_on_a_fresh_machine_installs_dev_torch_and_vllm(tmp_path: Path) -> None:
    root = tree(tmp_path)
    installs = planned(root, "setup")
    assert any("'.[dev,runtime]'" in line for line in installs)
    assert any("vllm-test.txt" in line and "--no-deps" in line for line in installs)


def test_serve_after_test_installs_nothing(tmp_path: Path) -> None:
    """No downgrade: the test install counts as the serving one."""
    root = tree(tmp_path)
    stamp(root, SERVE_STAMP, TEST_STAMP)
    assert planned(root, "serve") == []


def test_test_after_serve_adds_what_tests_need(tmp_path: Path) -> None:
    root = tree(tmp_path)
    stamp(root, SERVE_STAMP)
    assert any("'.[dev,runtime]'" in line for line in planned(root, "setup"))


def test_a_changed_pyproject_reinstalls_each(tmp_path: Path) -> None:
    root = tree(tmp_path)
    stamp(root, SERVE_STAMP, TEST_STAMP)
    (root / "pyproject.toml").touch()
    age(root / SERVE_STAMP, 60)
    age(root / TEST_STAMP, 60)
    (serve,) = planned(root, "serve")
    assert serve.rstrip().endswith(" -e .")
    assert any("'.[dev,runtime]'" in line for line in planned(root, "setup"))
