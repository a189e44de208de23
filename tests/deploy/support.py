"""Shared pieces of the deploy tests: repository paths, the unpacked Prometheus tools, a
kvservice started in a background thread, and PromQL/exposition helpers."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        body: bytes = response.read()
    return body.decode()


def http_json(url: str) -> Any:
    return json.loads(http_get(url))


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
