"""The package layout holds: which package may import which, no import cycle, and a
client or scheduler that loads nothing of the server.

The import graph is read from the sources (``ast``), not by importing them, so a
rule broken anywhere in the tree fails here whatever the tests import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvservice"
GENERATED = "kvservice.protocol.gen"

# Package -> the kvservice packages it may import (itself always). The core is the
# pure manager; the request table adapts it without I/O; ``protocol`` is what client
# and server agree on; the client and the scheduler never reach into the server.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "protocol": set(),
    "workloads": set(),
    "request_table": {"core"},
    "client": {"protocol"},
    "scheduler": {"core", "client", "request_table", "workloads", "replication"},
    "server": {"core", "protocol", "request_table"},
    "bench": {"core", "client", "protocol", "scheduler", "server", "workloads"},
    # The entry point imports the commands only once gRPC's fork handlers are off.
    "cli": {"server"},
    "commands": {"core", "server", "bench"},
    "integrations": {"core", "client", "replication"},
    # Where the client's vocabulary meets the core's, for replicas and in-process runs.
    "replication": {"core", "client"},
}
# The build selection (standard library only): every package that runs compiled
# imports it, whatever its layer may import otherwise.
BUILD_MODULE = "kvservice.core.compiled"
# Loaded by grpc itself on ``import grpc`` (aliases as grpc.health, grpc.reflection);
# only their submodules are server code.
SERVER_SIDE_MODULES = (
    "kvservice.server",
    "grpc_health.",
    "grpc_reflection.",
    "prometheus_client",
    "structlog",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: path for name, path in found.items() if not name.startswith(GENERATED)}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (those under ``if TYPE_CHECKING:`` do not)."""
    for node in ast.iter_child_nodes(tree):
        if _type_checking_only(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    """kvservice module -> the kvservice modules it imports. ``from pkg import name``
    counts as an import of ``pkg.name`` when that is a module: the package's own
    ``__init__`` is then not what is read."""
    modules = _modules()
    known = set(modules) | {GENERATED, f"{GENERATED}.kv_cache_service_pb2"}
    known.add(f"{GENERATED}.kv_cache_service_pb2_grpc")
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                assert node.level == 0, f"{name}: relative import"
                base = node.module or ""
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
                ]
            edges.update(t for t in targets if t.split(".")[0] == "kvservice" and t != name)
        graph[name] = edges
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvservice"


def package_graph() -> dict[str, set[str]]:
    """Package -> the other kvservice packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        mine = package_of(module)
        others = {package_of(t) for t in targets - {BUILD_MODULE}} - {mine, "kvservice"}
        packages.setdefault(mine, set()).update(others)
    return packages


def test_packages_import_only_what_the_layering_allows() -> None:
    for package, imported in package_graph().items():
        if package == "kvservice":
            continue
        assert imported <= ALLOWED[package], f"{package} imports {imported - ALLOWED[package]}"


def test_no_import_cycle() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_client_and_scheduler_load_nothing_of_the_server() -> None:
    """In a fresh interpreter, importing the client and the reference scheduler loads
    no module of the server, nor grpc's server-side helpers, metrics or logging."""
    code = (
        "import json, sys\n"
        "import kvservice.client\n"
        "import kvservice.scheduler.backend, kvservice.scheduler.replicated\n"
        "import kvservice.scheduler.loop, kvservice.scheduler.trace\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    loaded = json.loads(out)
    assert "kvservice.client" in loaded and "kvservice.scheduler.replicated" in loaded
    assert [m for m in loaded if m.startswith(SERVER_SIDE_MODULES)] == []


# The one remote-step mechanism, and the schedulers' adapters that reach a server by it.
REMOTE_STEP = "kvservice.client.step_link"
REMOTE_STEP_USERS = ("kvservice.scheduler.replicated", "kvservice.integrations.vllm.server_link")


def _steps_sent_by(path: Path) -> bool:
    """Whether a module sends steps of its own: builds a ``StepBuilder``."""
    return any(
        isinstance(node, ast.Call) and ast.unparse(node.func).endswith("StepBuilder")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
    )


def test_both_schedulers_reach_the_server_through_one_remote_step_mechanism() -> None:
    """vLLM's scheduler and the reference scheduler record a step on a replica and send
    it by ``StepLink``; nothing outside the client builds steps of its own."""
    graph = import_graph()
    for user in REMOTE_STEP_USERS:
        assert REMOTE_STEP in graph[user], f"{user} does not build on {REMOTE_STEP}"
    builders = {
        name
        for name, path in _modules().items()
        if not name.startswith("kvservice.client.") and _steps_sent_by(path)
    }
    assert builders == set(), f"steps built outside the remote-step mechanism: {builders}"
