"""The compiled core: the build a process imports is the one it asked for, and a build
that does not match the sources is refused, never imported.

``make test`` runs this file twice, compiled and with ``KVSERVICE_PURE_PYTHON=1``. The
refusals are checked in a copy of the package, imported by a child process.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvservice.core
from kvservice.core import compiled
from kvservice.core.block_pool import BlockPool

ROOT = Path(__file__).resolve().parents[2]
PURE = os.environ.get(compiled.PURE_PYTHON_ENV) == "1"
BUILD_PRESENT = not compiled.stale_reasons()


def test_the_core_loaded_is_the_one_asked_for() -> None:
    assert kvservice.core.COMPILED is not PURE
    build = compiled.module_dir(compiled.build_dir())
    names = [p.stem for p in compiled.compiled_sources()]
    assert "block_pool" in names and "kv_cache_manager" in names
    for name in names:
        module = importlib.import_module(f"kvservice.core.{name}")
        expected = (
            compiled.CORE_DIR / f"{name}.py" if PURE else build / f"{name}{compiled.EXT_SUFFIX}"
        )
        assert module.__file__ == str(expected)
        assert Path(module.__file__).is_file()
    # Native code, not Python functions that happen to come from an .so's directory.
    assert inspect.isfunction(BlockPool.get_new_blocks) is PURE
    for name in sorted(compiled.NOT_COMPILED - {"__init__.py"}):
        module = importlib.import_module(f"kvservice.core.{Path(name).stem}")
        assert module.__file__ == str(compiled.CORE_DIR / name)


# -- a copy of the package, imported by a child process --------------------------------

PROBE = (
    "import kvservice.core as core, kvservice.core.block_pool as block_pool; "
    "print(core.COMPILED, block_pool.__file__)"
)

needs_build = pytest.mark.skipif(
    not BUILD_PRESENT, reason="no compiled build matches these sources (pure-Python run)"
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """kvservice/__init__.py and kvservice/core/ with its compiled build, copied."""
    (tmp_path / "kvservice").mkdir()
    shutil.copy(ROOT / "kvservice" / "__init__.py", tmp_path / "kvservice")
    shutil.copytree(
        compiled.CORE_DIR, tmp_path / "kvservice" / "core", ignore=shutil.ignore_patterns("*.pyc")
    )
    return tmp_path


def import_from(tree: Path, pure: str = "0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), compiled.PURE_PYTHON_ENV: pure}
    command = [sys.executable, "-c", PROBE]
    return subprocess.run(command, check=False, cwd=tree, env=env, capture_output=True, text=True)


def refusal(tree: Path) -> str:
    result = import_from(tree)
    assert result.returncode != 0, result.stdout
    assert "CompiledCoreError" in result.stderr
    assert "make build" in result.stderr and "KVSERVICE_PURE_PYTHON=1" in result.stderr
    return result.stderr


def core(tree: Path) -> Path:
    return tree / "kvservice" / "core"


def build_of(tree: Path) -> Path:
    return compiled.build_dir(core(tree))


@needs_build
def test_a_matching_copy_imports_its_own_build(tree: Path) -> None:
    result = import_from(tree)
    assert result.returncode == 0, result.stderr
    shim = compiled.module_dir(build_of(tree)) / f"block_pool{compiled.EXT_SUFFIX}"
    assert result.stdout.split() == ["True", str(shim)]


@needs_build
def test_an_edited_source_is_refused_not_shadowed(tree: Path) -> None:
    source = core(tree) / "block_pool.py"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    assert "block_pool.py changed" in refusal(tree)
    # The sources still import, on request.
    result = import_from(tree, pure="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", str(source)]


@needs_build
def test_a_new_or_removed_module_is_refused(tree: Path) -> None:
    (core(tree) / "new_module.py").write_text("X = 1\n")
    (core(tree) / "stats.py").unlink()
    message = refusal(tree)
    assert "new_module.py is new" in message and "stats.py was removed" in message


@needs_build
def test_a_build_missing_a_piece_is_refused(tree: Path) -> None:
    modules = compiled.module_dir(build_of(tree))
    (modules / f"block_pool{compiled.EXT_SUFFIX}").rename(modules / f"old{compiled.EXT_SUFFIX}")
    message = refusal(tree)
    assert "the extension of block_pool.py is missing" in message
    assert f"old{compiled.EXT_SUFFIX} is not part of the build" in message
    shutil.rmtree(build_of(tree))
    assert "there is no compiled build" in refusal(tree)


@needs_build
def test_a_build_for_another_python_is_refused(tree: Path) -> None:
    manifest_path = build_of(tree) / compiled.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["ext_suffix"] = ".cpython-399-x86_64-linux-gnu.so"
    manifest_path.write_text(json.dumps(manifest))
    assert "built for .cpython-399" in refusal(tree)


def test_an_unclear_mode_is_refused(tree: Path) -> None:
    result = import_from(tree, pure="yes")
    assert result.returncode != 0
    assert "KVSERVICE_PURE_PYTHON='yes'" in result.stderr


@needs_build
def test_the_makefiles_check_tells_a_stale_build(tree: Path) -> None:
    """``make build`` recompiles exactly when this check fails."""
    check = [sys.executable, "-P", str(core(tree) / "compiled.py")]
    assert subprocess.run(check, check=False, capture_output=True).returncode == 0
    (core(tree) / "request.py").write_text("# edited\n")
    result = subprocess.run(check, check=False, capture_output=True, text=True)
    assert result.returncode == 1 and "request.py changed" in result.stdout


@pytest.mark.skipif(PURE, reason="builds a wheel: once per suite, in the compiled run")
def test_a_wheel_carries_a_build_of_its_own_sources(tmp_path: Path) -> None:
    """``pip install .`` (the Docker image's install) compiles the core into the package,
    from the sources the wheel ships: this tree's, built in pip's build environment."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), "."],
        cwd=ROOT,
        check=True,
    )
    (wheel,) = tmp_path.glob("kvservice-*.whl")
    assert not wheel.name.endswith("-none-any.whl")  # platform-specific: it holds binaries
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    wheel_core = unpacked / "kvservice" / "core"
    assert compiled.stale_reasons(wheel_core) == []
    assert compiled.source_digests(wheel_core) == compiled.source_digests()
    result = import_from(unpacked)
    assert result.returncode == 0, result.stderr
    shim = compiled.module_dir(compiled.build_dir(wheel_core)) / f"block_pool{compiled.EXT_SUFFIX}"
    assert result.stdout.split() == ["True", str(shim)]
