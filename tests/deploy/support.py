"""Shared pieces of the deploy tests: repository paths, the unpacked Prometheus tools, a
kvservice started in a background thread, and PromQL/exposition helpers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvservice.server.app import ServerHandle, serve_in_background
from kvservice.server.config import ServerConfig
from tests.server import support as server_support

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "kvservice.json"
ALERTS = GRAFANA / "alerts.yaml"
ALERTS_TEST = GRAFANA / "alerts_test.yaml"
CHART = ROOT / "helm" / "kvservice"

PROMETHEUS_BIN = ROOT / ".tools" / "prometheus" / "usr" / "bin"
PROMTOOL = PROMETHEUS_BIN / "promtool"
PROMETHEUS = PROMETHEUS_BIN / "prometheus"

# What Grafana puts in place of its variables when the tests evaluate a dashboard query.
RATE_INTERVAL = "5m"

# The server tests' small pool (10 usable blocks of 16 tokens), with metrics served.
SMALL_POOL = dataclasses.replace(
    server_support.SMALL_POOL, metrics_port=0, model_name="deploy-test"
)


def tool(path: Path) -> Path:
    """A binary from .tools/, or a test failure saying how to get it (never a skip)."""
    if not path.is_file():
        pytest.fail(f"{path.relative_to(ROOT)} is missing: run `make tools` (make test does)")
    return path


def run_tool(*args: str | Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        body: bytes = response.read()
    return body.decode()


def http_json(url: str) -> Any:
    return json.loads(http_get(url))


# --- a kvservice in a thread of its own ------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackgroundServer:
    handle: ServerHandle

    @property
    def metrics_url(self) -> str:
        assert self.handle.metrics_url is not None
        return self.handle.metrics_url

    @property
    def metrics_address(self) -> str:
        return f"{self.handle.host}:{self.handle.metrics_port}"


@contextmanager
def background_server(config: ServerConfig = SMALL_POOL) -> Iterator[BackgroundServer]:
    """``serve_in_background`` on an event loop in a thread, so synchronous tests (and a
    synchronous gRPC channel) can use the server while Prometheus scrapes it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kvservice-loop", daemon=True)
    thread.start()
    stop = asyncio.Event()
    started: asyncio.Future[ServerHandle] = loop.create_future()

    async def main() -> None:
        try:
            async with serve_in_background(config) as handle:
                started.set_result(handle)
                await stop.wait()
        except BaseException as err:
            if not started.done():
                started.set_exception(err)
            raise

    async def wait_started() -> ServerHandle:
        return await started

    task = asyncio.run_coroutine_threadsafe(main(), loop)
    try:
        handle = asyncio.run_coroutine_threadsafe(wait_started(), loop).result(timeout=60)
        yield BackgroundServer(handle)
    finally:
        loop.call_soon_threadsafe(stop.set)
        task.result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()


# --- exposition and PromQL ---------------------------------------------------------------

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.MULTILINE)
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def exported_series_names(exposition: str) -> set[str]:
    """Every series name a Prometheus scrape of this text can produce: the samples present
    plus, for each declared family, the names its type implies (a labelled family with no
    child yet has a # TYPE line but no sample)."""
    names = set(_SAMPLE_LINE.findall(exposition))
    for family, kind in _TYPE_LINE.findall(exposition):
        base = family.removesuffix("_total") if kind == "counter" else family
        names.update(base + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names in ``by (...)``/``on (...)`` or label matchers."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\boffset\s+\d+[smhdwy]", "", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def label_values_metric(query: str) -> str | None:
    """The metric of a Grafana ``label_values(metric{...}, label)`` variable query."""
    match = re.fullmatch(
        r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*,.*", query
    )
    return match.group(1) if match else None


def substitute_variables(expr: str) -> str:
    """Grafana's variables as a dashboard with every filter on "All" sends them."""
    text = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", RATE_INTERVAL)
    return re.sub(r"\$\{?(model_name|instance|engine|job)\}?", ".*", text)


@dataclass(frozen=True, slots=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str

    @property
    def id(self) -> str:
        return f"{self.panel}/{self.ref_id}"


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows nest theirs
    return panels


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[PanelQuery]:
    dashboard = dashboard or load_dashboard()
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"])
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]
