"""Which build of the core is imported: the mypyc-compiled modules, or these sources.

Installing the project (``make build``, any ``pip install``) compiles the core with mypyc
into ``kvservice/core/_compiled/``, a directory the import system never searches on its
own. ``kvservice/core/__init__.py`` puts it first on the package's path only after
checking that every compiled module was built from the exact bytes of its ``.py`` here
(the build records their SHA-256 in ``_compiled/manifest.json``). So an edited source is
never shadowed by an older binary: the import fails instead, naming what changed.

``KVSERVICE_PURE_PYTHON=1`` imports the sources, for debugging and profiling.

This module and ``__init__.py`` run before the build is on the path, so they are never
compiled; it uses the standard library only, so that ``setup.py`` can load it by path
and ``python -P kvservice/core/compiled.py`` can tell the Makefile whether to rebuild.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

PURE_PYTHON_ENV = "KVSERVICE_PURE_PYTHON"
CORE_DIR = Path(__file__).resolve().parent
BUILD_DIR_NAME = "_compiled"
MANIFEST_NAME = "manifest.json"
# mypyc puts every module's code in one shared library (so calls between modules are
# native); each module's own extension is a shim that initializes it from there.
GROUP_NAME = "kvservice_core"
GROUP_LIBRARY = f"{GROUP_NAME}__mypyc"
EXT_SUFFIX: str = sysconfig.get_config_var("EXT_SUFFIX")
# Left as sources: errors.py, whose exception classes mypyc cannot make native (nothing
# to gain) and whose class attributes it drops unless declared ClassVar (which the
# server's per-instance ``status`` rules out); invariants.py subclasses AssertionError,
# which mypyc refuses; admission.py's generic dataclasses compile (mypyc 2.4.1) into a
# module that fails at import ("attribute '__dict__' of 'type' objects is not writable").
# The last two run once per step or audit, not per block.
NOT_COMPILED = frozenset(
    {"__init__.py", "admission.py", "compiled.py", "errors.py", "invariants.py"}
)


class CompiledCoreError(ImportError):
    """The compiled core cannot be used with these sources (missing, or built from
    other bytes); the message says how to rebuild it or run the sources."""


def pure_python_requested() -> bool:
    value = os.environ.get(PURE_PYTHON_ENV, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise CompiledCoreError(
        f"{PURE_PYTHON_ENV}={value!r}: set it to 1 to import the core's sources, "
        "or to 0 (or unset it) for the compiled core"
    )


def compiled_sources(core_dir: Path = CORE_DIR) -> list[Path]:
    """The core's modules that the build compiles, by name."""
    return sorted(p for p in core_dir.glob("*.py") if p.name not in NOT_COMPILED)


def source_digests(core_dir: Path = CORE_DIR) -> dict[str, str]:
    """Module name -> SHA-256 of its source, for every module the build compiles."""
    return {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in compiled_sources(core_dir)}


def build_dir(core_dir: Path = CORE_DIR) -> Path:
    return core_dir / BUILD_DIR_NAME


def module_dir(build: Path) -> Path:
    """Where the modules' extensions lie: below the shared library as their package
    path, the layout mypyc derives their ``__file__`` from."""
    return build / "kvservice" / "core"


def write_manifest(build: Path, digests: dict[str, str]) -> None:
    """Record what ``build`` was compiled from; written last, once the build is whole."""
    manifest = {"ext_suffix": EXT_SUFFIX, "modules": digests}
    (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def stale_reasons(core_dir: Path = CORE_DIR) -> list[str]:
    """Why the compiled build next to ``core_dir``'s sources cannot be used with them;
    empty when it can."""
    build = build_dir(core_dir)
    try:
        manifest = json.loads((build / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return [f"there is no compiled build in {build}"]
    if manifest["ext_suffix"] != EXT_SUFFIX:
        return [f"it was built for {manifest['ext_suffix']}, this Python loads {EXT_SUFFIX}"]
    built: dict[str, str] = manifest["modules"]
    now = source_digests(core_dir)
    reasons = []
    for name in sorted(built.keys() | now.keys()):
        if name not in now:
            reasons.append(f"{name}.py was removed")
        elif name not in built:
            reasons.append(f"{name}.py is new")
        elif built[name] != now[name]:
            reasons.append(f"{name}.py changed")
        elif not (module_dir(build) / f"{name}{EXT_SUFFIX}").is_file():
            reasons.append(f"the extension of {name}.py is missing")
    strays = {p.name for p in module_dir(build).glob(f"*{EXT_SUFFIX}")} - {
        f"{name}{EXT_SUFFIX}" for name in built
    }
    reasons.extend(f"{name} is not part of the build" for name in sorted(strays))
    if not (build / f"{GROUP_LIBRARY}{EXT_SUFFIX}").is_file():
        reasons.append(f"{GROUP_LIBRARY}{EXT_SUFFIX} is missing")
    return reasons


def activate(package_path: list[str]) -> bool:
    """Put the compiled build first on ``kvservice.core``'s path, unless the sources
    were asked for; True when the compiled modules will be imported. Raises
    ``CompiledCoreError`` rather than import a build made from other sources."""
    if pure_python_requested():
        return False
    reasons = stale_reasons()
    if reasons:
        raise CompiledCoreError(
            f"kvservice.core: the compiled core does not match the sources in {CORE_DIR} ("
            + "; ".join(reasons)
            + "). Rebuild it with `make build` (or `python setup.py build_ext --inplace`), "
            f"or import the sources with {PURE_PYTHON_ENV}=1."
        )
    build = build_dir()
    _load_group_library(build)
    package_path.insert(0, str(module_dir(build)))
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
        print("compiled core out of date: " + "; ".join(reasons))
        return 1
    print(f"compiled core up to date ({build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
