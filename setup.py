"""The build step pyproject.toml cannot declare: ``kvservice/core``,
``kvservice/request_table`` and the per-operation modules of ``kvservice/server``,
``kvservice/client`` and ``kvservice/replication`` compiled with mypyc (each package's
``NOT_COMPILED`` says which), and the C modules of those packages (their ``.c`` files)
beside them.

Every install (``pip install .``, ``pip install -e .``, hence ``make setup``) and
``python setup.py build_ext --inplace`` compile their modules, as one mypyc group, into
``kvservice/_compiled/`` (a wheel ships it inside the package) and record the SHA-256
of each source they were built from; ``kvservice/core/compiled.py`` imports the build
only while the sources still match. mypyc comes from ``build-system.requires``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

from mypyc.build import mypycify
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_compiled() -> ModuleType:
    # By path: importing the package would run the selection this build feeds.
    spec = importlib.util.spec_from_file_location(
        "_kvservice_core_compiled", ROOT / "kvservice" / "core" / "compiled.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compiled = _load_compiled()
# Where the build goes, as a package path: extension names decide file locations.
BUILD_PACKAGE = "kvservice." + compiled.BUILD_DIR_NAME


def _native_extension(path: Path) -> Extension:
    """A C module of a compiled package (``kvservice/core/_native_hashing.c``: vLLM's
    block hash with OpenSSL's SHA-256, the library hashlib links too)."""
    return Extension(
        f"kvservice.{path.parent.name}.{path.stem}",
        sources=[os.path.relpath(path, ROOT)],
        libraries=["crypto"],
    )


class BuildCompiled(build_ext):
    """``build_ext`` that compiles the core and the request table with mypyc into
    ``kvservice/_compiled`` (also for editable installs, which would otherwise put the
    extensions next to the sources, where they would shadow any later edit)."""

    def finalize_options(self) -> None:
        sources = compiled.compiled_sources()
        self.digests = compiled.source_digests()
        extensions = mypycify(
            [os.path.relpath(p, ROOT) for p in sources],
            group_name=compiled.GROUP_NAME,
            target_dir=os.path.join("build", "mypyc"),
        ) + [_native_extension(path) for path in compiled.native_sources()]
        if compiled.source_digests() != self.digests:
            raise SystemExit("a source changed while mypyc read them: build again")
        for ext in extensions:
            ext.name = f"{BUILD_PACKAGE}.{ext.name}"
        self.distribution.ext_modules = extensions
        super().finalize_options()

    def run(self) -> None:
        built = Path(self.build_lib, *BUILD_PACKAGE.split("."))
        # Only this build's extensions: a module no longer compiled leaves no shim.
        shutil.rmtree(built, ignore_errors=True)
        in_tree = self.inplace
        self.inplace = False
        super().run()
        self.inplace = in_tree
        compiled.write_manifest(built, self.digests)
        if in_tree:
            self._replace_tree_build(built)

    def _replace_tree_build(self, built: Path) -> None:
        # A new directory, then a rename: a running process keeps the files it mapped,
        # and a reader sees the old build whole, or none, or the new one whole.
        target = compiled.build_dir()
        staging = target.with_name(target.name + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(built, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


setup(
    # Replaced by the mypyc extensions when build_ext runs (never in a metadata-only
    # step, which need not type-check the sources); its presence makes the wheel
    # platform-specific and schedules build_ext.
    ext_modules=[Extension(f"{BUILD_PACKAGE}.{compiled.GROUP_LIBRARY}", sources=[])],
    cmdclass={"build_ext": BuildCompiled},
)
