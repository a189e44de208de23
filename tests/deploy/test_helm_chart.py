"""The Helm chart, rendered and linted by a real Helm engine (helm-python-sdk: Helm v4's Go
SDK through ctypes, offline) and validated against the Kubernetes 1.30 schemas
(kubernetes-validate, bundled). The Prometheus Operator kinds are CRDs those schemas lack:
they are checked structurally here."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import re
import tomllib
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kvservice.cli import build_parser
from kvservice.request_table.limits import RequestLimits
from kvservice.server.config import ServerConfig
from tests.deploy.support import ALERTS, CHART, DASHBOARD

KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "kv", "ml"
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {
        "gpu": {"enabled": True, "count": 1},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
        ],
    },
    "tls": {
        "tls": {
            "enabled": True,
            "secretName": "kv-tls",
            "clientCA": {"enabled": True, "secretName": "kv-ca"},
        },
        "auth": {"enabled": True, "token": "s3cret"},
    },
    "monitoring": {
        "monitoring": {"enabled": True, "serviceMonitor": {"labels": {"release": "prom"}}},
        "config": {"noneHashSeed": "shared", "zeroNewBlocks": True, "hashAlgo": "xxhash"},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return manifests["kvservice/templates/NOTES.txt"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = main
    return result


def serve_flags() -> set[str]:
    """The option strings of `kvservice serve`, from the CLI's own parser."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = commands.choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings}


@pytest.mark.parametrize("case", MATRIX)
def test_lint_strict(case: str) -> None:
    """`helm lint --strict` (warnings are errors) for each values set, schema included."""
    report = helm.lint(CHART, MATRIX[case], strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == [], report


@pytest.mark.parametrize("case", MATRIX)
def test_renders_valid_kubernetes(case: str) -> None:
    """Every rendered core object validates against the Kubernetes schemas (strict: no
    unknown fields); the CRD objects have the apiVersion, kind and fields the Prometheus
    Operator requires."""
    docs = render(MATRIX[case])
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            check_crd_object(doc)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def check_crd_object(doc: dict[str, Any]) -> None:
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    spec = doc["spec"]
    if doc["kind"] == "ServiceMonitor":
        assert spec["selector"]["matchLabels"]
        for endpoint in spec["endpoints"]:
            assert isinstance(endpoint["port"], str)
            assert re.fullmatch(r"\d+(ms|s|m)", endpoint["interval"])
            assert re.fullmatch(r"\d+(ms|s|m)", endpoint["scrapeTimeout"])
    else:
        assert set(spec) == {"groups"}
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert ("alert" in rule) != ("record" in rule)
                assert isinstance(rule["expr"], str)
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}


def test_defaults_shape() -> None:
    """One pod owning one pool: one replica, Recreate; non-root, read-only root, no
    privilege escalation, all capabilities dropped; native gRPC probes on grpc.health.v1;
    a gRPC Service and a metrics Service; a ConfigMap; a PodDisruptionBudget; no GPU, no
    monitoring objects, no Secrets."""
    docs = render({})
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceAccount",
    ]  # fmt: skip
    (deployment,) = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    main = container(docs)
    assert main["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert main["readinessProbe"]["grpc"] == {
        "port": 50051,
        "service": "kvservice.v1.KVCacheService",
    }
    assert main["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert "nvidia.com/gpu" not in main["resources"]["limits"]
    assert main["resources"]["requests"] and main["resources"]["limits"]
    services = {s["metadata"]["name"]: s["spec"]["ports"] for s in by_kind(docs, "Service")}
    assert services == {
        "kv-kvservice": [
            {
                "name": "grpc",
                "port": 50051,
                "targetPort": "grpc",
                "protocol": "TCP",
                "appProtocol": "grpc",
            }
        ],
        "kv-kvservice-metrics": [
            {
                "name": "metrics",
                "port": 9400,
                "targetPort": "metrics",
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ],
    }
    assert "volumes" in pod and [v["name"] for v in pod["volumes"]] == ["tmp"]


def test_container_args_are_kvservice_serve_flags() -> None:
    """Every flag the chart passes exists in `kvservice serve`; it binds 0.0.0.0 for gRPC
    and metrics on the declared container ports; each $(VAR) is an env var read from the
    chart's ConfigMap, which holds the configured values."""
    values = MATRIX["monitoring"]
    docs = render(values)
    main = container(docs)
    flags = serve_flags()
    args: list[str] = main["args"]
    for arg in args:
        assert arg.split("=", 1)[0] in flags, arg
    assert {
        "--host=0.0.0.0",
        "--metrics-host=0.0.0.0",
        "--port=50051",
        "--metrics-port=9400",
    } <= set(args)
    assert "--zero-new-blocks" in args
    assert [p["containerPort"] for p in main["ports"]] == [50051, 9400]
    (configmap,) = [
        c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "kv-kvservice"
    ]
    env = {e["name"]: e for e in main["env"]}
    resolved = {}
    for arg in args:
        match = re.fullmatch(r"(--[a-z-]+)=\$\((\w+)\)", arg)
        if match:
            ref = env[match.group(2)]["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == "kv-kvservice"
            resolved[match.group(1)] = configmap["data"][ref["key"]]
    assert resolved == {
        "--model-name": "default",
        "--num-blocks": "4096",
        "--block-size": "16",
        "--max-model-len": "8192",
        "--vocab-size": "0",
        "--hash-algo": "xxhash",
        "--log-level": "info",
        "--shutdown-grace": "5",
        "--gc-full-collection-interval": "60",
        # The server's own default.
        "--loop-stall-interval": str(ServerConfig().loop_stall_interval_s),
        "--eviction-policy": "lru",
        "--max-pinned-fraction": "0",
        "--none-hash-seed": "shared",
        # The chart's limits are the server's own defaults.
        **{
            "--" + field.name.replace("_", "-"): str(getattr(RequestLimits(), field.name))
            for field in dataclasses.fields(RequestLimits)
        },
        # And so are its session and stream limits.
        **{
            "--" + name.replace("_", "-"): str(getattr(ServerConfig(), name))
            for name in (
                "max_sessions_per_tenant",
                "max_sessions",
                "max_step_streams_per_tenant",
                "max_step_streams",
            )
        },
    }
    # The CLI accepts what the chart passes (the $(VAR)s expanded as the kubelet does).
    build_parser().parse_args(
        [
            "serve",
            *(re.sub(r"\$\((\w+)\)", lambda m: configmap["data"][m.group(1)], a) for a in args),
        ]
    )


def test_gpu_values() -> None:
    """gpu.enabled requests and limits nvidia.com/gpu, adds its toleration to the user's and
    keeps the node selector."""
    docs = render(MATRIX["gpu"])
    main = container(docs)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert main["resources"]["requests"]["nvidia.com/gpu"] == "1"
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]


def test_tls_and_auth_secrets_mounted() -> None:
    """tls/mTLS/auth mount their Secrets read-only; the token Secret is created from
    auth.token; enabling TLS without a secret name fails the render."""
    docs = render(MATRIX["tls"])
    main = container(docs)
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert {"tls", "client-ca", "auth"} <= set(mounts)
    assert all(mounts[n]["readOnly"] for n in ("tls", "client-ca", "auth"))
    volumes = {
        v["name"]: v for v in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["tls"]["secret"]["secretName"] == "kv-tls"
    assert volumes["client-ca"]["secret"]["secretName"] == "kv-ca"
    (secret,) = by_kind(docs, "Secret")
    assert volumes["auth"]["secret"]["secretName"] == secret["metadata"]["name"]
    # The server is told where each Secret is, so it serves TLS, mTLS and tokens; the
    # chart-made Secret is a tokens file of one tenant.
    assert {
        "--tls-cert-file=/etc/kvservice/tls/tls.crt",
        "--tls-key-file=/etc/kvservice/tls/tls.key",
        "--tls-client-ca-file=/etc/kvservice/client-ca/ca.crt",
        "--auth-tokens-file=/etc/kvservice/auth/token",
    } <= set(main["args"])
    assert "--allow-insecure-bind" not in main["args"]
    tokens_file = tomllib.loads(base64.b64decode(secret["data"]["token"]).decode())
    assert tokens_file == {"tenants": {"default": {"tokens": ["s3cret"]}}}
    assert "Security: TLS with client certificates (mTLS), bearer tokens" in notes(MATRIX["tls"])
    # Without TLS and client authentication the pod IP is bound only when told so.
    assert "--allow-insecure-bind" in container(render({}))["args"]
    assert "--allow-insecure-bind" in notes({})
    with pytest.raises(helm.HelmError, match=r"tls\.secretName is required"):
        render({"tls": {"enabled": True}})
    with pytest.raises(helm.HelmError, match=r"auth\.token"):
        render({"auth": {"enabled": True}})


def test_monitoring_objects_match_grafana() -> None:
    """With monitoring on: a ServiceMonitor selecting the metrics Service's port; a
    PrometheusRule whose spec is grafana/alerts.yaml; the dashboard ConfigMap labelled
    grafana_dashboard: "1" holding grafana/kvservice.json."""
    docs = render(MATRIX["monitoring"])
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (metrics_service,) = [
        s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics")
    ]
    labels = metrics_service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] == metrics_service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    (dashboard,) = [
        c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvservice.json"]) == json.loads(DASHBOARD.read_text())


def test_chart_files_are_copies() -> None:
    """The chart's files/ are byte-for-byte copies of grafana/ (Helm cannot read outside the
    chart): `cp grafana/alerts.yaml grafana/kvservice.json helm/kvservice/files/` after an edit."""
    assert (CHART / "files" / "alerts.yaml").read_bytes() == ALERTS.read_bytes()
    assert (CHART / "files" / "kvservice.json").read_bytes() == DASHBOARD.read_bytes()


@pytest.mark.parametrize(
    "bad",
    [
        {"config": {"numBlocks": "4096"}},
        {"gpu": {"enabled": "yes"}},
        {"grpc": {"port": 70000}},
        {"config": {"hashAlgo": "md5"}},
        {"monitoring": {"serviceMonitor": {"interval": 15}}},
        {"podDisruptionBudget": {"maxUnavailable": 2}},
        {"replicaCount": 2},
        {"tolerations": {"key": "x"}},
    ],
    ids=str,
)
def test_schema_rejects(bad: dict[str, Any]) -> None:
    """values.schema.json rejects wrong types, out-of-range values and unknown keys
    (replicaCount is not a value: one release is one pool)."""
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
        for values in MATRIX.values():
            chart.validate_schema(values)


def test_values_documented() -> None:
    """Every key in values.yaml has a comment line right above it, except the fields of
    the Kubernetes objects passed through verbatim (resources, security contexts, list items)."""
    passthrough = (
        "resources:",
        "podSecurityContext:",
        "securityContext:",
        "tolerations:",
        "labels:",
    )
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    inside: int | None = None  # indentation of the pass-through block we are in
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if inside is not None and indent > inside:
            continue
        inside = None
        if re.match(r"[\w.-]+:", stripped):
            previous = lines[i - 1].strip() if i else ""
            if not previous.startswith("#"):
                undocumented.append(stripped)
            if stripped in passthrough:
                inside = indent
    assert undocumented == []
