"""Which build of the compiled packages is imported: the mypyc-compiled modules, or
their sources.

A package of ``kvservice`` runs compiled when its ``__init__.py`` declares which of its
modules stay sources (``NOT_COMPILED``, read from the file, never imported; see
``compiled_packages``): the core declares its own, and each package above it that runs
compiled declares its own, so this module names no package. Installing the project
(``make build``, any ``pip install``) compiles them with mypyc, as one group (one
shared library, so calls between the packages are native calls), into
``kvservice/_compiled/``, a directory the import system never searches on its own.
Each package's ``__init__.py`` puts its part of the build first on the package's path
only after checking that every compiled module of every compiled package was built
from the exact bytes of its ``.py`` here, and every C module (a package's ``.c``
files, see ``native_sources``) from its ``.c`` (the build records their SHA-256 in
``_compiled/manifest.json``). So an edited source is never shadowed by an older
binary: the import fails instead, naming what changed. The build is one library, so
it is used whole or not at all.

``KVSERVICE_PURE_PYTHON=1`` imports the sources of all of them, for debugging and
profiling.

This module and the packages' ``__init__.py`` run before the build is on the path, so
they are never compiled; it uses the standard library only, so that ``setup.py`` can
load it by path and ``python -P kvservice/core/compiled.py`` can tell the Makefile
whether to rebuild. It lives in the core, which imports nothing outside itself; the
packages above import it from here.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

PURE_PYTHON_ENV = "KVSERVICE_PURE_PYTHON"
# The ``kvservice`` package directory: the compiled packages and the build lie in it.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
CORE_DIR = PACKAGE_DIR / "core"
BUILD_DIR_NAME = "_compiled"
MANIFEST_NAME = "manifest.json"
# mypyc puts every module's code in one shared library (so calls between modules, and
# between the packages, are native); each module's own extension is a shim that
# initializes it from there.
GROUP_NAME = "kvservice"
GROUP_LIBRARY = f"{GROUP_NAME}__mypyc"
EXT_SUFFIX: str = sysconfig.get_config_var("EXT_SUFFIX")
# The name a compiled package's ``__init__.py`` assigns, at its top level, a tuple of
# the file names of its modules that stay sources (a literal: it is read with ``ast``,
# since importing the package would run the selection this module makes). Its
# ``__init__.py`` always stays a source; each package's declaration says why the others
# do.
DECLARATION = "NOT_COMPILED"


class CompiledCoreError(ImportError):
    """The compiled build cannot be used with these sources (missing, or built from
    other bytes); the message says how to rebuild it or run the sources."""


def pure_python_requested() -> bool:
    value = os.environ.get(PURE_PYTHON_ENV, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise CompiledCoreError(
        f"{PURE_PYTHON_ENV}={value!r}: set it to 1 to import the sources of the compiled "
        "packages, or to 0 (or unset it) for their compiled build"
    )


def _declared_sources(init: Path) -> frozenset[str] | None:
    """The ``NOT_COMPILED`` file names an ``__init__.py`` declares (itself included), or
    None when it declares none (a package that is not compiled)."""
    text = init.read_text(encoding="utf-8")
    if DECLARATION not in text:
        return None
    for node in ast.parse(text, str(init)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == DECLARATION for t in targets):
            names: tuple[str, ...] = ast.literal_eval(value)
            return frozenset({init.name, *names})
    return None


def compiled_packages(package_dir: Path = PACKAGE_DIR) -> dict[str, frozenset[str]]:
    """The packages of ``package_dir`` that run compiled -> the file names of their
    modules that stay sources, as each ``__init__.py`` declares them."""
    packages: dict[str, frozenset[str]] = {}
    for init in sorted(package_dir.glob("*/__init__.py")):
        left_out = _declared_sources(init)
        if left_out is not None:
            packages[init.parent.name] = left_out
    return packages


def not_compiled(package: str, package_dir: Path = PACKAGE_DIR) -> frozenset[str]:
    """The file names of ``package``'s modules that stay sources."""
    return compiled_packages(package_dir)[package]


def compiled_sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The modules the build compiles, package by package, by name."""
    return [
        path
        for package, left_out in compiled_packages(package_dir).items()
        for path in sorted((package_dir / package).glob("*.py"))
        if path.name not in left_out
    ]


def native_sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The C extensions the build compiles beside mypyc's: each ``.c`` file of a
    compiled package is one module of that package, named by its stem (OpenSSL's
    libcrypto linked in; ``setup.py`` builds them)."""
    return [
        path
        for package in compiled_packages(package_dir)
        for path in sorted((package_dir / package).glob("*.c"))
    ]


def module_key(path: Path) -> str:
    """How the manifest names a compiled module: by its source, ``package/file``."""
    return f"{path.parent.name}/{path.name}"


def extension_name(key: str) -> str:
    """The file a module's extension takes below the build's ``kvservice`` directory."""
    return key.rpartition(".")[0] + EXT_SUFFIX


def source_digests(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """``package/file`` -> SHA-256 of that source, for every module the build compiles
    (mypyc's ``.py`` and the C modules' ``.c``)."""
    return {
        module_key(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in compiled_sources(package_dir) + native_sources(package_dir)
    }


def build_dir(package_dir: Path = PACKAGE_DIR) -> Path:
    return package_dir / BUILD_DIR_NAME


def module_dir(build: Path, package: str) -> Path:
    """Where ``package``'s extensions lie: below the shared library as their package
    path, the layout mypyc derives their ``__file__`` from."""
    return build / "kvservice" / package


def write_manifest(build: Path, digests: dict[str, str]) -> None:
    """Record what ``build`` was compiled from; written last, once the build is whole."""
    manifest = {"ext_suffix": EXT_SUFFIX, "modules": digests}
    (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def stale_reasons(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Why the compiled build next to ``package_dir``'s sources cannot be used with
    them; empty when it can."""
    build = build_dir(package_dir)
    try:
        manifest = json.loads((build / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return [f"there is no compiled build in {build}"]
    if manifest["ext_suffix"] != EXT_SUFFIX:
        return [f"it was built for {manifest['ext_suffix']}, this Python loads {EXT_SUFFIX}"]
    built: dict[str, str] = manifest["modules"]
    now = source_digests(package_dir)
    reasons = []
    for key in sorted(built.keys() | now.keys()):
        if key not in now:
            reasons.append(f"{key} was removed")
        elif key not in built:
            reasons.append(f"{key} is new")
        elif built[key] != now[key]:
            reasons.append(f"{key} changed")
        elif not (build / "kvservice" / extension_name(key)).is_file():
            reasons.append(f"the extension of {key} is missing")
    expected = {extension_name(key) for key in built}
    for package in compiled_packages(package_dir):
        found = {f"{package}/{p.name}" for p in module_dir(build, package).glob(f"*{EXT_SUFFIX}")}
        reasons.extend(f"{name} is not part of the build" for name in sorted(found - expected))
    if not (build / f"{GROUP_LIBRARY}{EXT_SUFFIX}").is_file():
        reasons.append(f"{GROUP_LIBRARY}{EXT_SUFFIX} is missing")
    return reasons


def activate(package: str, package_path: list[str]) -> bool:
    """Put the compiled build of ``kvservice.<package>`` first on its path, unless the
    sources were asked for; True when the compiled modules will be imported. Raises
    ``CompiledCoreError`` rather than import a build made from other sources."""
    if pure_python_requested():
        return False
    reasons = stale_reasons()
    if reasons:
        raise CompiledCoreError(
            f"kvservice.{package}: the compiled build does not match the sources in "
            f"{PACKAGE_DIR} ("
            + "; ".join(reasons)
            + "). Rebuild it with `make build` (or `python setup.py build_ext --inplace`), "
            f"or import the sources with {PURE_PYTHON_ENV}=1."
        )
    build = build_dir()
    _load_group_library(build)
    package_path.insert(0, str(module_dir(build, package)))
    return True


def _load_group_library(build: Path) -> None:
    # The shims import the shared library by its top-level name: load it from the
    # build by path, so that the build never has to be on sys.path.
    if GROUP_LIBRARY in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        GROUP_LIBRARY, build / f"{GROUP_LIBRARY}{EXT_SUFFIX}"
    )
    assert spec is not None and spec.loader is not None
    library = importlib.util.module_from_spec(spec)
    sys.modules[GROUP_LIBRARY] = library
    spec.loader.exec_module(library)


def main() -> int:
    """Exit status 0 when the compiled build matches the sources, 1 when it must be
    (re)built; the Makefile's ``build`` target asks before compiling."""
    reasons = stale_reasons()
    if reasons:
        print("compiled build out of date: " + "; ".join(reasons))
        return 1
    print(f"compiled build up to date ({build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
