"""Every operator mistake at startup is one line on stderr and exit status 2, from a
real `kvservice serve` (or `kvservice bench`) process: no traceback, no gRPC log line.
And what an operator expects to find: the startup line says whether TLS and auth are
on, an IPv6 host works, HTTP /health and /ready answer on the metrics port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.client import AsyncKVClient, ServiceUnavailableError
from kvservice.server.probes import LOOP_TIMEOUT_S
from tests.server.support import SMALL_POOL
from tests.server.test_security import ADMIN_TOKEN, Pki, pki, tokens_file  # noqa: F401 (fixtures)
from tests.servers import TIMEOUT_S, kvservice_serve, run_kvservice, running_server

SMALL = ("--num-blocks=64", "--max-model-len=256")
WITH_METRICS = dataclasses.replace(SMALL_POOL, metrics_port=0)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_the_grpc_port_in_use() -> None:
    with taken_port() as port:
        status, _, stderr = await run_kvservice("serve", f"--port={port}", "--no-metrics", *SMALL)
    assert status == 2
    line = one_line(stderr)
    assert f"127.0.0.1:{port}" in line and "in use" in line and "--port" in line


async def test_the_metrics_port_in_use() -> None:
    with taken_port() as port:
        status, _, stderr = await run_kvservice(
            "serve", "--port=0", f"--metrics-port={port}", *SMALL
        )
    assert status == 2
    line = one_line(stderr)
    assert f"127.0.0.1:{port}" in line and "in use" in line and "--metrics-port" in line


@pytest.mark.parametrize("num_blocks", ["-5", "0", "1"])
async def test_a_pool_without_a_usable_block(num_blocks: str) -> None:
    status, _, stderr = await run_kvservice(
        "serve", "--port=0", "--no-metrics", f"--num-blocks={num_blocks}"
    )
    assert status == 2
    line = one_line(stderr)
    assert f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}" in line


async def test_a_tls_key_that_does_not_match_its_certificate(pki: Pki) -> None:  # noqa: F811
    status, _, stderr = await run_kvservice(
        "serve",
        "--port=0",
        "--no-metrics",
        f"--tls-cert-file={pki.path('server.pem')}",
        f"--tls-key-file={pki.path('client.key')}",
        *SMALL,
    )
    assert status == 2
    line = one_line(stderr)
    assert "client.key" in line and "server.pem" in line and "does not match" in line


@pytest.mark.parametrize("setting", ["cert", "key", "client-ca"])
async def test_a_tls_file_that_is_not_pem(
    pki: Pki,  # noqa: F811
    tmp_path: Path,
    setting: str,
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\x01 not a PEM file\n")
    files = {
        "cert": pki.path("server.pem"),
        "key": pki.path("server.key"),
        "client-ca": pki.path("ca.pem"),
    }
    files[setting] = str(garbage)
    status, _, stderr = await run_kvservice(
        "serve",
        "--port=0",
        "--no-metrics",
        f"--tls-cert-file={files['cert']}",
        f"--tls-key-file={files['key']}",
        f"--tls-client-ca-file={files['client-ca']}",
        *SMALL,
    )
    assert status == 2
    line = one_line(stderr)
    assert f"tls_{setting.replace('-', '_')}_file" in line and "PEM" in line


async def test_an_ipv6_host_and_the_startup_line() -> None:
    """--host ::1 serves on [::1]; the startup line says TLS and auth are off."""
    async with kvservice_serve(
        "--host=::1", "--metrics-host=::1", "--metrics-port=0", *SMALL, metrics=True
    ) as (process, serving):
        assert serving["address"] == f"[::1]:{serving['port']}"
        assert (serving["tls"], serving["auth"]) == ("off", "off")
        async with grpc.aio.insecure_channel(serving["address"]) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
            )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert serving["metrics_url"].startswith("http://[::1]:")
        for path in ("/health", "/ready"):
            url = serving["metrics_url"].removesuffix("/metrics") + path
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
                assert answer.status == 200
        process.terminate()
        await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    assert process.returncode == 0


async def test_the_startup_line_says_tls_and_auth_are_on(
    pki: Pki,  # noqa: F811
    tokens_file: str,  # noqa: F811
) -> None:
    async with kvservice_serve(
        f"--tls-cert-file={pki.path('server.pem')}",
        f"--tls-key-file={pki.path('server.key')}",
        f"--tls-client-ca-file={pki.path('ca.pem')}",
        f"--auth-tokens-file={tokens_file}",
        *SMALL,
    ) as (process, serving):
        assert (serving["tls"], serving["auth"]) == ("mtls", "tokens")
        assert serving["tenants"] == 4
        process.terminate()
        await asyncio.wait_for(process.communicate(), TIMEOUT_S)


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode().strip()


async def get(url: str) -> tuple[int, str]:
    """GET from a thread (the server's loop is this one: it must stay free)."""
    return await asyncio.to_thread(fetch, url)


async def test_http_health_and_readiness() -> None:
    """/health: the loop answers; /ready: also taking calls (503 once it drains)."""
    async with running_server(WITH_METRICS) as server:
        base = f"http://127.0.0.1:{server.handle.metrics_port}"
        assert await get(f"{base}/health") == (200, "ok")
        assert await get(f"{base}/ready") == (200, "ok")
        assert (await get(f"{base}/metrics"))[0] == 200
        server._drain.begin()  # what stop() does first
        status, body = await get(f"{base}/ready")
        assert status == 503 and "not taking calls" in body
        assert await get(f"{base}/health") == (200, "ok")


async def test_a_stuck_loop_is_not_healthy() -> None:
    async with running_server(WITH_METRICS) as server:
        url = f"http://127.0.0.1:{server.handle.metrics_port}/health"
        answers: list[tuple[int, str]] = []
        prober = threading.Thread(target=lambda: answers.append(fetch(url)))
        prober.start()
        time.sleep(LOOP_TIMEOUT_S + 1.0)  # the loop stuck (no await) past the probe's wait
        await asyncio.to_thread(prober.join, TIMEOUT_S)
        status, body = answers[0]
        assert status == 503 and "did not respond" in body
        assert await get(url) == (200, "ok")  # and healthy again


async def test_a_client_on_a_tls_port_without_a_ca_gets_a_hint(pki: Pki) -> None:  # noqa: F811
    config = dataclasses.replace(
        SMALL_POOL, tls_cert_file=pki.path("server.pem"), tls_key_file=pki.path("server.key")
    )
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target, timeout=10) as client,
    ):
        with pytest.raises(ServiceUnavailableError) as info:
            await client.get_usage()
    assert "TLS" in str(info.value) and "root_certificates" in str(info.value)


async def test_bench_at_a_dead_address() -> None:
    with taken_port() as port:
        pass  # closed again: nothing listens there now
    status, _, stderr = await run_kvservice(
        "bench", "--smoke", "--no-progress", f"--target=127.0.0.1:{port}"
    )
    assert status == 2
    line = one_line(stderr)
    assert f"127.0.0.1:{port}" in line and "--target" in line


async def test_bench_at_a_tls_server(
    pki: Pki,  # noqa: F811
    tokens_file: str,  # noqa: F811
) -> None:
    """Without a CA: one line with the hint; with --tls-ca and --token: it runs."""
    config = dataclasses.replace(
        SMALL_POOL,
        num_blocks=96,
        max_model_len=1024,
        tls_cert_file=pki.path("server.pem"),
        tls_key_file=pki.path("server.key"),
        auth_tokens_file=tokens_file,
    )
    async with running_server(config) as server:
        target = server.handle.target
        status, _, stderr = await run_kvservice(
            "bench", "--smoke", "--no-progress", f"--target={target}"
        )
        assert status == 2
        assert "--tls-ca" in one_line(stderr)
        status, out, stderr = await run_kvservice(
            "bench",
            "--smoke",
            "--no-progress",
            "--modes=in-process,step",
            f"--target={target}",
            f"--tls-ca={pki.path('ca.pem')}",
            f"--token={ADMIN_TOKEN}",  # the bench resets the prefix cache: admin
        )
        assert status == 0, stderr
        assert "step" in out
