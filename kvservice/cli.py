"""``kvservice``: the command line entry point (``kvservice serve``, ``bench``, ``demo``;
see ``kvservice.commands``).

It imports nothing that imports grpc before it has told gRPC not to register fork
handlers (``kvservice.server.forking``): gRPC reads that once, when it is imported,
and the pool audit's forked snapshot is only safe without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from kvservice.server.forking import disable_grpc_fork_handlers


def _commands() -> ModuleType:
    disable_grpc_fork_handlers()
    return importlib.import_module("kvservice.commands")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser: argparse.ArgumentParser = _commands().build_parser()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvservice``; the exit status."""
    status: int = _commands().main(argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
