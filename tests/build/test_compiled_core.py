"""The compiled build (the core, the request table and the server's Step path): the
build a process imports is the one it asked for, and a build that does not match the
sources is refused, never imported.

``make test`` runs this file twice, compiled and with ``KVSERVICE_PURE_PYTHON=1``. The
refusals are checked in a copy of the packages, imported by a child process.
"""

from __future__ import annotations

import ast
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

from kvservice.core import compiled
from kvservice.core.block_pool import BlockPool
from kvservice.request_table.table import RequestTable

ROOT = Path(__file__).resolve().parents[2]
PURE = os.environ.get(compiled.PURE_PYTHON_ENV) == "1"
BUILD_PRESENT = not compiled.stale_reasons()


@pytest.mark.parametrize("package", sorted(compiled.compiled_packages()))
def test_the_build_loaded_is_the_one_asked_for(package: str) -> None:
    assert importlib.import_module(f"kvservice.{package}").COMPILED is not PURE
    build = compiled.module_dir(compiled.build_dir(), package)
    sources = compiled.PACKAGE_DIR / package
    names = [p.stem for p in compiled.compiled_sources() if p.parent.name == package]
    assert names
    for name in names:
        module = importlib.import_module(f"kvservice.{package}.{name}")
        expected = sources / f"{name}.py" if PURE else build / f"{name}{compiled.EXT_SUFFIX}"
        assert module.__file__ == str(expected)
        assert Path(module.__file__).is_file()
    for name in sorted(compiled.not_compiled(package) - {"__init__.py"}):
        module = importlib.import_module(f"kvservice.{package}.{Path(name).stem}")
        assert module.__file__ == str(sources / name)


def test_the_hot_paths_are_native_code() -> None:
    """Native code, not Python functions that happen to come from an .so's directory."""
    assert {
        "core/block_pool.py",
        "core/kv_cache_manager.py",
        "request_table/table.py",
        "core/_native_hashing.c",
    } <= set(compiled.source_digests())
    assert inspect.isfunction(BlockPool.get_new_blocks) is PURE
    assert inspect.isfunction(RequestTable.allocate_slots) is PURE


# The server compiles its Step path only: every other module of it stays a source.
SERVER_STEP_PATH = {"step.py", "operations.py", "converters.py", "slice_clock.py"}
SERVER_SOURCES = {
    p.name for p in (Path(compiled.PACKAGE_DIR) / "server").glob("*.py")
} - SERVER_STEP_PATH

# The client compiles its remote-step recording and checking only.
CLIENT_STEP_PATH = {"step_log.py", "step_link.py", "_wire.py"}
CLIENT_SOURCES = {
    p.name for p in (Path(compiled.PACKAGE_DIR) / "client").glob("*.py")
} - CLIENT_STEP_PATH


def test_each_compiled_package_declares_its_own_sources() -> None:
    """The packages compiled are those whose ``__init__.py`` says which of their
    modules stay sources; the core's build module names none of them."""
    assert compiled.compiled_packages() == {
        "core": {"__init__.py", "compiled.py", "errors.py", "invariants.py"},
        "request_table": {"__init__.py", "errors.py", "tenant_keys.py"},
        "server": set(SERVER_SOURCES),
        "client": set(CLIENT_SOURCES),
        "replication": {"__init__.py", "retention.py"},
    }


def test_a_declaration_is_read_not_imported(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "__init__.py").write_text('"""NOT_COMPILED only in prose."""\n')
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast" / "__init__.py").write_text(
        "raise ImportError('never run')\nNOT_COMPILED: tuple[str, ...] = ('slow.py',)\n"
    )
    for name in ("fast.py", "slow.py"):
        (tmp_path / "fast" / name).write_text("X = 1\n")
    assert compiled.compiled_packages(tmp_path) == {"fast": {"__init__.py", "slow.py"}}
    assert compiled.compiled_sources(tmp_path) == [tmp_path / "fast" / "fast.py"]


def test_the_core_names_no_package_above_it() -> None:
    """The core is the bottom layer: no module of it names another kvservice package,
    not even as a string (tests/test_layout.py checks the imports)."""
    others = {p.parent.name for p in compiled.PACKAGE_DIR.glob("*/__init__.py")} - {"core"}
    others |= {p.stem for p in compiled.PACKAGE_DIR.glob("*.py")} - {"__init__"}
    for path in sorted(compiled.CORE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = {
                    other
                    for other in others
                    if node.value == other
                    or f"kvservice.{other}" in node.value
                    or f"kvservice/{other}" in node.value
                }
                assert not named, f"{path.name}:{node.lineno} names {sorted(named)}"


# -- a copy of the packages, imported by a child process -------------------------------

PROBE = (
    "import kvservice.core as core, kvservice.core.block_pool as block_pool; "
    "import kvservice.request_table as rt, kvservice.request_table.table as table; "
    "print(core.COMPILED, block_pool.__file__, rt.COMPILED, table.__file__)"
)

needs_build = pytest.mark.skipif(
    not BUILD_PRESENT, reason="no compiled build matches these sources (pure-Python run)"
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """kvservice/__init__.py, the compiled packages and their build, copied."""
    (tmp_path / "kvservice").mkdir()
    shutil.copy(ROOT / "kvservice" / "__init__.py", tmp_path / "kvservice")
    copied = [*compiled.compiled_packages()]
    if BUILD_PRESENT:
        copied.append(compiled.BUILD_DIR_NAME)
    for name in copied:
        shutil.copytree(
            compiled.PACKAGE_DIR / name,
            tmp_path / "kvservice" / name,
            ignore=shutil.ignore_patterns("*.pyc"),
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


def package(tree: Path) -> Path:
    return tree / "kvservice"


def build_of(tree: Path) -> Path:
    return compiled.build_dir(package(tree))


def shims(build: Path) -> list[str]:
    """What a compiled run of PROBE prints for ``build``."""
    return [
        "True",
        str(compiled.module_dir(build, "core") / f"block_pool{compiled.EXT_SUFFIX}"),
        "True",
        str(compiled.module_dir(build, "request_table") / f"table{compiled.EXT_SUFFIX}"),
    ]


@needs_build
def test_a_matching_copy_imports_its_own_build(tree: Path) -> None:
    result = import_from(tree)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == shims(build_of(tree))


@needs_build
@pytest.mark.parametrize(
    "source", ["core/block_pool.py", "request_table/table.py", "core/_native_hashing.c"]
)
def test_an_edited_source_is_refused_not_shadowed(tree: Path, source: str) -> None:
    path = package(tree) / source
    path.write_text(path.read_text() + "\n# edited after the build\n")
    assert f"{source} changed" in refusal(tree)
    # The sources still import, on request.
    result = import_from(tree, pure="1")
    assert result.returncode == 0, result.stderr
    sources = package(tree)
    assert result.stdout.split() == [
        "False",
        str(sources / "core" / "block_pool.py"),
        "False",
        str(sources / "request_table" / "table.py"),
    ]


@needs_build
def test_an_edited_table_source_refuses_the_table_too(tree: Path) -> None:
    """The build is one library: the table is refused whichever package imports first."""
    path = package(tree) / "request_table" / "types.py"
    path.write_text(path.read_text() + "\n# edited after the build\n")
    env = {**os.environ, "PYTHONPATH": str(tree), compiled.PURE_PYTHON_ENV: "0"}
    result = subprocess.run(
        [sys.executable, "-c", "import kvservice.request_table.table"],
        check=False,
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "CompiledCoreError" in result.stderr
    assert "request_table/types.py changed" in result.stderr


@needs_build
def test_a_new_or_removed_module_is_refused(tree: Path) -> None:
    (package(tree) / "core" / "new_module.py").write_text("X = 1\n")
    (package(tree) / "request_table" / "new_table_module.py").write_text("X = 1\n")
    (package(tree) / "core" / "stats.py").unlink()
    (package(tree) / "request_table" / "limits.py").unlink()
    message = refusal(tree)
    assert "core/new_module.py is new" in message and "core/stats.py was removed" in message
    assert "request_table/new_table_module.py is new" in message
    assert "request_table/limits.py was removed" in message


@needs_build
def test_a_source_left_out_of_the_build_may_change(tree: Path) -> None:
    """A module that stays a source is imported as one: editing it needs no rebuild."""
    path = package(tree) / "request_table" / "tenant_keys.py"
    path.write_text(path.read_text() + "\n# edited after the build\n")
    result = import_from(tree)
    assert result.returncode == 0, result.stderr


@needs_build
def test_a_build_missing_a_piece_is_refused(tree: Path) -> None:
    ext = compiled.EXT_SUFFIX
    core_modules = compiled.module_dir(build_of(tree), "core")
    (core_modules / f"block_pool{ext}").rename(core_modules / f"old{ext}")
    (compiled.module_dir(build_of(tree), "request_table") / f"table{ext}").unlink()
    (core_modules / f"_native_hashing{ext}").unlink()
    message = refusal(tree)
    assert "the extension of core/block_pool.py is missing" in message
    assert "the extension of request_table/table.py is missing" in message
    assert "the extension of core/_native_hashing.c is missing" in message
    assert f"core/old{ext} is not part of the build" in message
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
@pytest.mark.parametrize(
    "source", ["core/request.py", "request_table/table.py", "core/_native_hashing.c"]
)
def test_the_makefiles_check_tells_a_stale_build(tree: Path, source: str) -> None:
    """``make build`` recompiles exactly when this check fails."""
    check = [sys.executable, "-P", str(package(tree) / "core" / "compiled.py")]
    assert subprocess.run(check, check=False, capture_output=True).returncode == 0
    (package(tree) / source).write_text("# edited\n")
    result = subprocess.run(check, check=False, capture_output=True, text=True)
    assert result.returncode == 1 and f"{source} changed" in result.stdout


@pytest.mark.skipif(PURE, reason="builds a wheel: once per suite, in the compiled run")
def test_a_wheel_carries_a_build_of_its_own_sources(tmp_path: Path) -> None:
    """``pip install .`` (the Docker image's install) compiles the core, the request
    table, the server's Step path, the client's step recording and the replicas' request
    tracking into the package, from the sources the wheel ships: this tree's, built in
    pip's build environment."""
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
    wheel_package = unpacked / "kvservice"
    assert compiled.stale_reasons(wheel_package) == []
    assert compiled.source_digests(wheel_package) == compiled.source_digests()
    assert {p.parent.name for p in compiled.compiled_sources(wheel_package)} == {
        "core",
        "request_table",
        "server",
        "client",
        "replication",
    }
    result = import_from(unpacked)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == shims(compiled.build_dir(wheel_package))
