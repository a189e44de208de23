"""The Grafana dashboard and the Prometheus alert rules, checked with the real promtool and
against the /metrics of a real kvservice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import (
    ALERTS,
    ALERTS_TEST,
    PROMTOOL,
    SMALL_POOL,
    all_panels,
    dashboard_queries,
    exported_series_names,
    http_get,
    label_values_metric,
    load_dashboard,
    promql_metric_names,
    run_tool,
    substitute_variables,
    tool,
)
from tests.servers import server_in_thread

FILTERS = ("model_name", "instance", "engine")


def test_dashboard_structure() -> None:
    """Loads as JSON; uid, schemaVersion and unique panel ids; a Prometheus datasource
    variable used by every panel and target; multi-value $model_name/$instance/$engine
    filters from label_values, applied in every query."""
    dashboard = load_dashboard()
    assert dashboard["uid"] == "kvservice-kv-cache"
    assert isinstance(dashboard["schemaVersion"], int)
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in FILTERS:
        var = variables[name]
        assert var["type"] == "query"
        assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
        assert label_values_metric(var["query"]["query"]) is not None
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), f"{panel['title']}: describe what it shows"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            for name in FILTERS:
                assert f'{name}=~"${name}"' in target["expr"], (panel["title"], name)


def test_dashboard_has_the_panels_vllm_users_know() -> None:
    """The hit rate comes from the counters with the divide-by-zero guard; usage is a max
    (never a sum); latency quantiles aggregate buckets by le and method."""
    exprs = {q.panel: q.expr for q in dashboard_queries()}
    hit_rate = exprs["Prefix cache hit rate"]
    assert "sum(rate(vllm:prefix_cache_hits_total{" in hit_rate
    assert "[$__rate_interval])) / (sum(rate(vllm:prefix_cache_queries_total{" in hit_rate
    assert hit_rate.endswith("[$__rate_interval])) > 0)")
    assert exprs["Max KV cache usage"].startswith("max(vllm:kv_cache_usage_perc{")
    assert exprs["KV cache usage by engine"].startswith(
        "max by (instance, engine) (vllm:kv_cache_usage_perc{"
    )
    no_space = exprs["No-space rate"]
    assert 'result="no_space"' in no_space and no_space.endswith("> 0)")
    latency = [q.expr for q in dashboard_queries() if q.panel.startswith("RPC latency")]
    assert {e.split(",")[0] for e in latency} == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
    }
    assert all(
        "sum by (le, method) (rate(kvservice_rpc_duration_seconds_bucket" in e for e in latency
    )


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every query (variables substituted as Grafana would) is valid PromQL for promtool:
    written as recording rules and checked with `promtool check rules`."""
    queries = dashboard_queries()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": substitute_variables(q.expr)}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = run_tool(tool(PROMTOOL), "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_every_panel_metric_is_exported() -> None:
    """Every metric a panel or variable names is in the exposition of a real kvservice
    (started here on free ports). Strict: a pending metric name fails this test."""
    dashboard = load_dashboard()
    wanted: dict[str, set[str]] = {}
    for query in dashboard_queries(dashboard):
        for name in promql_metric_names(query.expr):
            wanted.setdefault(name, set()).add(query.panel)
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            metric = label_values_metric(var["query"]["query"])
            assert metric is not None
            wanted.setdefault(metric, set()).add(f"${var['name']}")
    with server_in_thread(SMALL_POOL) as server:
        exported = exported_series_names(http_get(server.metrics_url))
    missing = {name: sorted(panels) for name, panels in wanted.items() if name not in exported}
    assert not missing, f"metrics the dashboard queries but the service does not export: {missing}"


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_check() -> None:
    """`promtool check rules` accepts grafana/alerts.yaml."""
    result = run_tool(tool(PROMTOOL), "check", "rules", ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in result.stdout


def test_alert_rules_unit_tests() -> None:
    """`promtool test rules grafana/alerts_test.yaml`: each alert fires on its series,
    not on a healthy neighbour and not before its `for:` elapses."""
    result = run_tool(tool(PROMTOOL), "test", "rules", ALERTS_TEST)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_are_complete_and_tested() -> None:
    """Each alert has a severity, a `for:`, summary and description, names only exported
    metric families, and has a firing case in alerts_test.yaml."""
    rules = _alert_rules()
    names = {rule["alert"] for rule in rules}
    assert names == {
        "KVServiceCacheNearFull",
        "KVServicePrefixCacheHitRateDrop",
        "KVServiceAllocationNoSpace",
        "KVServiceRpcLatencyHigh",
        "KVServiceKVEventsLost",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["for"], rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert promql_metric_names(rule["expr"]), rule["alert"]
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    quiet = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if not case["exp_alerts"]
    }
    assert fired == names and quiet == names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (le, method) (rate(kvservice_rpc_duration_seconds_bucket{a=~"$a"}[5m]))',
            {"kvservice_rpc_duration_seconds_bucket"},
        ),
        (
            "sum(rate(vllm:prefix_cache_hits_total[1h] offset 1h)) / (sum(rate(x_total[5m])) > 0)",
            {"vllm:prefix_cache_hits_total", "x_total"},
        ),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m]))) > 0.05", {"h_bucket"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    """The extractor the exported-metrics checks rely on."""
    assert promql_metric_names(expr) == names
