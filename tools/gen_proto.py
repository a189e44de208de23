"""Regenerate ``kvservice/protocol/gen/`` from ``proto/`` (``make proto``).

Runs the protoc bundled with grpcio-tools (Debian's is too old) with the python, grpc
and mypy-protobuf plugins, then moves the modules into one flat package. protoc writes
imports from the proto path (``from kvservice.v1 import ...``), which is not where the
modules live, so the import lines are rewritten to ``kvservice.protocol.gen``. Only
import lines and qualified module references are touched: the serialized descriptors
must keep the proto package name ``kvservice.v1``.

Usage: ``python tools/gen_proto.py [--out DIR]`` (default: the committed package; the
drift test passes a temporary directory and compares).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE_DIR = Path("kvservice") / "v1"
DEFAULT_OUT = ROOT / "kvservice" / "protocol" / "gen"
TARGET_PACKAGE = "kvservice.protocol.gen"

INIT_TEXT = '"""Generated protobuf and gRPC code: run ``make proto``, do not edit."""\n'

# `from kvservice.v1 import x_pb2` and `kvservice.v1.x_pb2` (in the .pyi stubs).
_FROM_IMPORT = re.compile(r"^from kvservice\.v1 import ", re.MULTILINE)
_QUALIFIED = re.compile(r"\bkvservice\.v1\.(\w+_pb2(?:_grpc)?)\b")


def _plugin(name: str) -> str:
    """The plugin next to this interpreter (the venv), else on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        sys.exit(f"{name} not found: install the dev extras (pip install -e '.[dev]')")
    return found


def run_protoc(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        # The server and its clients use grpc.aio only.
        f"--mypy_grpc_out=only_async:{out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def fix_imports(text: str) -> str:
    text = _FROM_IMPORT.sub(f"from {TARGET_PACKAGE} import ", text)
    return _QUALIFIED.sub(rf"{TARGET_PACKAGE}.\1", text)


def generate(out: Path) -> list[Path]:
    """Write the generated package into ``out`` (replacing what is there); returns
    the files written."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.py"), *out.glob("*.pyi")]:
        stale.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        generated = sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir())
        written = [out / "__init__.py"]
        written[0].write_text(INIT_TEXT)
        for src in generated:
            dst = out / src.name
            dst.write_text(fix_imports(src.read_text()))
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package dir")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
