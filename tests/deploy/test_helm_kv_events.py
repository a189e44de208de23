"""The chart's KV event stream (kvEvents): rendered and linted by the real Helm engine,
validated against the Kubernetes schemas, and its flags read back by `kvservice serve`'s
own settings into the server that would run."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from kvservice.cli import build_parser
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.settings import load_settings
from kvservice.server.zmq_events.config import KVEventsConfig
from tests.deploy.support import CHART
from tests.deploy.test_helm_chart import KUBE_VERSION, by_kind, container, render, serve_flags

ON: dict[str, Any] = {"kvEvents": {"enabled": True}}
SECURE: dict[str, Any] = {
    "tls": {"enabled": True, "secretName": "kv-tls"},
    "auth": {"enabled": True, "token": "s3cret-s3cret-s3cret"},
}
CASES: dict[str, dict[str, Any]] = {
    "on": ON,
    "loopback-tls": {
        "kvEvents": {"enabled": True, "bindHost": "127.0.0.1", "replayPort": 0},
        **SECURE,
    },
    "tuned": {
        "kvEvents": {
            "enabled": True,
            "port": 6557,
            "replayPort": 6558,
            "topic": "kv@pool-0",
            "bufferSteps": 500,
            "hwm": 2000,
            "maxQueueSize": 3000,
            "intBlockHashes": False,
            "service": {"annotations": {"example.com/router": "llm-d"}},
        }
    },
}


def server_config(values: dict[str, Any]) -> ServerConfig:
    """What `kvservice serve` runs with, from the rendered args and the ConfigMap (the
    $(VAR)s expanded as the kubelet does, the environment the container gets)."""
    docs = render(values)
    main = container(docs)
    (configmap,) = [
        c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "kv-kvservice"
    ]
    data = configmap["data"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in main["args"]]
    parsed = build_parser().parse_args(["serve", *args])
    env = {
        e["name"]: data[e["valueFrom"]["configMapKeyRef"]["key"]]
        for e in main["env"]
        if "valueFrom" in e
    }
    return load_settings(vars(parsed), env).server


@pytest.mark.parametrize("case", CASES)
def test_lint_and_kubernetes_schemas(case: str) -> None:
    report = helm.lint(CHART, CASES[case], strict=True, kube_version=f"v{KUBE_VERSION}")
    assert [m for m in report["messages"] if m["severity"] >= 2] == [] and not report["errors"]
    for doc in render(CASES[case]):  # no monitoring: only core kinds
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_off_by_default() -> None:
    docs = render({})
    assert not any(s["metadata"]["name"].endswith("-kv-events") for s in by_kind(docs, "Service"))
    assert not any(a.startswith("--kv-events") for a in container(docs)["args"])
    assert server_config({}).kv_events_config == KVEventsConfig()


def test_the_ports_are_on_a_cluster_ip_service() -> None:
    """Both sockets are container ports, and a ClusterIP Service of their own exposes
    them whatever the gRPC Service's type."""
    docs = render({**ON, "service": {"type": "LoadBalancer"}})
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9400, "kv-events": 5557, "kv-replay": 5558}
    (service,) = [
        s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-kv-events")
    ]
    assert service["metadata"]["name"] == "kv-kvservice-kv-events"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"},
        {"name": "kv-replay", "port": 5558, "targetPort": "kv-replay", "protocol": "TCP"},
    ]
    (deployment,) = by_kind(docs, "Deployment")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_server_reads_vllms_config_from_the_chart() -> None:
    """The flags the chart passes are `kvservice serve`'s, and they become vLLM's
    KVEventsConfig with the values given; binding the pod IP passes
    --allow-insecure-bind, so the server built from them starts its check clean."""
    values = CASES["tuned"]
    for arg in container(render(values))["args"]:
        assert arg.split("=", 1)[0] in serve_flags(), arg
    config = server_config(values)
    assert config.kv_events_config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:6557",
        replay_endpoint="tcp://*:6558",
        buffer_steps=500,
        hwm=2000,
        max_queue_size=3000,
        topic="kv@pool-0",
    )
    assert config.kv_events_bind_host == "0.0.0.0" and not config.kv_events_int_block_hashes
    assert config.allow_insecure_bind
    server = KVCacheServer(config)
    assert server.kv_event_publisher is not None
    assert server.kv_event_publisher.endpoint == "tcp://0.0.0.0:6557"
    (service,) = [
        s
        for s in by_kind(render(values), "Service")
        if s["metadata"]["name"].endswith("-kv-events")
    ]
    assert service["metadata"]["annotations"] == {"example.com/router": "llm-d"}


def test_a_loopback_stream_beside_a_secure_grpc_port_needs_no_consent() -> None:
    """With TLS and tokens on gRPC, only an off-loopback KV event stream adds
    --allow-insecure-bind; replayPort 0 leaves the replay socket out."""
    secure_loopback = container(render(CASES["loopback-tls"]))
    assert "--allow-insecure-bind" not in secure_loopback["args"]
    assert "kv-replay" not in {p["name"] for p in secure_loopback["ports"]}
    config = server_config(CASES["loopback-tls"])
    assert config.kv_events_config.replay_endpoint is None
    assert config.kv_events_bind_host == "127.0.0.1"
    secure_open = {"kvEvents": {"enabled": True}, **SECURE}
    assert "--allow-insecure-bind" in container(render(secure_open))["args"]


@pytest.mark.parametrize(
    "bad",
    [
        {"kvEvents": {"enabled": "yes"}},
        {"kvEvents": {"port": 70000}},
        {"kvEvents": {"hwm": 0}},
        {"kvEvents": {"bindHost": ""}},
        {"kvEvents": {"endpoint": "tcp://*:5557"}},
    ],
    ids=str,
)
def test_schema_rejects(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
        for values in CASES.values():
            chart.validate_schema(values)
