"""Security at the boundary, over real sockets: TLS and mutual TLS with certificates
made here by the ``openssl`` CLI, bearer tokens, admin-only calls, rate limits, bind
safety and size limits. Every refusal is checked to change nothing.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.cli import build_parser
from kvservice.client import AsyncKVClient, KVClient, StepBuilder
from kvservice.client.errors import InsecureTokenError, KVServiceError
from kvservice.protocol import RETRY_AFTER_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import KVCacheServer
from kvservice.server.auth import (
    TokenBucket,
    load_tokens_file,
    parse_tokens,
)
from kvservice.server.config import ServerConfig
from kvservice.server.tls import SecurityConfigError, is_loopback
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_tenants import write_tokens_file
from tests.servers import run_kvservice, running_server, server_in_thread

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl CLI")

TOKEN = secrets.token_urlsafe(24)
ADMIN_TOKEN = secrets.token_urlsafe(24)
LIMITED_TOKEN = secrets.token_urlsafe(24)
SLOW_TOKEN = secrets.token_urlsafe(24)


@dataclasses.dataclass(frozen=True)
class Pki:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and client
    certificates: one from the CA, one from a CA the server does not trust."""

    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(cwd: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", cwd=cwd,
    )  # fmt: skip


def _leaf(cwd: Path, name: str, ca: str, extensions: str) -> None:
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    cwd = tmp_path_factory.mktemp("pki")
    _ca(cwd, "ca")
    _ca(cwd, "rogue-ca")
    _leaf(cwd, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    _leaf(cwd, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(cwd, "rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth")
    return Pki(cwd)


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    return write_tokens_file(
        tmp_path / "tokens.toml",
        {
            "team": {"tokens": [TOKEN]},
            "ops": {"tokens": [ADMIN_TOKEN], "admin": True},
            # One call in the bucket, and a refill far slower than any test.
            "limited": {"tokens": [LIMITED_TOKEN], "rate_limit": 0.001, "burst": 3},
            # A steady 50 calls a second, one at a time.
            "slow": {"tokens": [SLOW_TOKEN], "rate_limit": 50.0, "burst": 1},
        },
    )


@pytest.fixture
def server_config(tokens_file: str) -> ServerConfig:
    """The ``server`` (and ``stub``) of this module: bearer tokens, no TLS."""
    return dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


async def refused(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value


def refusals(server: KVCacheServer, tenant: str, reason: str) -> float:
    labels = {**server.metrics.labels, "tenant": tenant, "reason": reason}
    return server.metrics.registry.get_sample_value("kvservice_refusals_total", labels) or 0.0


# -- bearer tokens ----------------------------------------------------------------------


async def test_a_call_without_a_token_is_unauthenticated_and_changes_nothing(
    server: KVCacheServer, stub: Any
) -> None:
    add = pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(20))
    error = await refused(stub.AddRequest(add), grpc.StatusCode.UNAUTHENTICATED)
    assert "authorization: Bearer <token>" in (error.details() or "")
    # The request was never added: the tenant can add it now, and only once.
    await stub.AddRequest(add, metadata=bearer(TOKEN))
    await refused(stub.AddRequest(add, metadata=bearer(TOKEN)), grpc.StatusCode.ALREADY_EXISTS)
    assert refusals(server, "", "unauthenticated") == 1
    server.audit()


WRONG = secrets.token_urlsafe(24)


@pytest.mark.parametrize(
    "value",
    [f"Bearer {WRONG}", f"Basic {TOKEN}", "Bearer", "Bearer  ", TOKEN, f"bearer {TOKEN}x"],
)
async def test_a_wrong_or_malformed_token_is_unauthenticated_and_not_echoed(
    stub: Any, value: str
) -> None:
    call = stub.GetUsage(pb.GetUsageRequest(), metadata=(("authorization", value),))
    error = await refused(call, grpc.StatusCode.UNAUTHENTICATED)
    details = error.details() or ""
    assert "Bearer <token>" in details
    # Neither what was sent nor a real token shows in the answer.
    assert TOKEN not in details and WRONG not in details


async def test_the_right_token_is_accepted_whatever_the_scheme_case(stub: Any) -> None:
    for scheme in ("Bearer", "bearer"):
        metadata = (("authorization", f"{scheme} {TOKEN}"),)
        usage = await stub.GetUsage(pb.GetUsageRequest(), metadata=metadata)
        assert usage.num_blocks == SMALL_POOL.num_blocks


async def test_streams_need_a_token_too(server: KVCacheServer) -> None:
    target = server.handle.target
    async with AsyncKVClient(target) as anonymous:
        step = StepBuilder()
        step.get_usage()
        with pytest.raises(KVServiceError) as info:
            async with anonymous.session() as session:
                await session.step(step)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with (
        AsyncKVClient(target, token=TOKEN, allow_insecure_token=True) as client,
        client.session() as session,
    ):
        step = StepBuilder()
        usage = step.get_usage()
        results = await session.step(step)
        assert results[usage].num_blocks == SMALL_POOL.num_blocks


async def test_health_checks_need_no_token(server: KVCacheServer) -> None:
    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_pool_wide_calls_are_for_admin_tenants(server: KVCacheServer, stub: Any) -> None:
    reset = pb.ResetPrefixCacheRequest()
    error = await refused(
        stub.ResetPrefixCache(reset, metadata=bearer(TOKEN)), grpc.StatusCode.PERMISSION_DENIED
    )
    assert "'team'" in (error.details() or "") and "admin" in (error.details() or "")
    answer = await stub.ResetPrefixCache(reset, metadata=bearer(ADMIN_TOKEN))
    assert answer.reset
    assert refusals(server, "team", "permission_denied") == 1


def test_the_blocking_client_sends_its_token(token_server_thread: Any) -> None:
    with KVClient(token_server_thread.target, token=TOKEN, allow_insecure_token=True) as client:
        client.add_request("sync-r", tokens(5))
        assert client.get_request("sync-r").num_tokens == 5
    with KVClient(token_server_thread.target) as anonymous, pytest.raises(KVServiceError) as info:
        anonymous.get_usage()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("client_class", [KVClient, AsyncKVClient])
async def test_the_client_will_not_send_a_token_in_plaintext_unless_told(
    client_class: type[KVClient] | type[AsyncKVClient], pki: Pki
) -> None:
    """A token over a plaintext channel is readable by anyone on the path: the client
    refuses to be built with one unless allow_insecure_token=True says it is meant
    (a loopback server without TLS); with TLS it needs no word."""
    with pytest.raises(InsecureTokenError) as info:
        client_class("127.0.0.1:1", token=TOKEN)
    message = str(info.value)
    assert "allow_insecure_token=True" in message and "root_certificates" in message
    assert TOKEN not in message
    for options in (
        {"allow_insecure_token": True},
        {"root_certificates": pki.read("ca.pem")},
        {"tls": True},
    ):
        client = client_class("127.0.0.1:1", token=TOKEN, **options)
        closed = client.close()
        if closed is not None:
            await closed
    await AsyncKVClient("127.0.0.1:1").close()  # no token: nothing to protect


@pytest.fixture
def token_server_thread(server_config: ServerConfig) -> Iterator[Any]:
    with server_in_thread(server_config) as s:
        yield s


# -- rate limits ------------------------------------------------------------------------


async def test_a_tenant_over_its_rate_is_refused_with_a_retry_hint(
    server: KVCacheServer, stub: Any
) -> None:
    usage = pb.GetUsageRequest()
    for _ in range(3):  # the burst
        await stub.GetUsage(usage, metadata=bearer(LIMITED_TOKEN))
    add = pb.AddRequestRequest(request_id="late", prompt_token_ids=tokens(4))
    error = await refused(
        stub.AddRequest(add, metadata=bearer(LIMITED_TOKEN)), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert "rate limit" in (error.details() or "")
    trailers = dict(error.trailing_metadata() or ())
    assert int(trailers[RETRY_AFTER_KEY]) > 0
    # Other tenants have their own budget.
    await stub.GetUsage(usage, metadata=bearer(TOKEN))
    assert refusals(server, "limited", "rate_limited") == 1
    # The refused AddRequest added nothing.
    assert (await stub.GetUsage(usage, metadata=bearer(TOKEN))).num_requests == 0


async def test_a_stream_over_the_rate_is_slowed_not_ended(server: KVCacheServer) -> None:
    """Stream messages count against the rate like calls, but a stream over it waits
    for its tokens instead of ending: every step is answered, in order, the wait is
    counted, nothing is refused."""
    async with (
        AsyncKVClient(server.handle.target, token=SLOW_TOKEN, allow_insecure_token=True) as client,
        client.session() as session,
    ):
        for n in range(6):
            step = StepBuilder()
            step.add_request(f"s{n}", tokens(4))
            usage = step.get_usage()
            assert (await session.step(step))[usage].num_requests == n + 1
    labels = {**server.metrics.labels, "tenant": "slow"}
    delay = server.metrics.registry.get_sample_value(
        "kvservice_rate_limit_delay_seconds_total", labels
    )
    assert delay is not None and delay > 0
    assert refusals(server, "slow", "rate_limited") == 0


def test_the_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=2, clock=lambda: now[0])
    assert bucket.take() == 0.0 and bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.5)
    now[0] = 0.25
    assert bucket.take() == pytest.approx(0.25)  # half a token saved; nothing taken
    now[0] = 0.5
    assert bucket.take() == 0.0
    now[0] = 100.0  # saving up stops at the burst
    assert [bucket.take() for _ in range(3)][:2] == [0.0, 0.0]


# -- TLS and mutual TLS -----------------------------------------------------------------


@pytest.fixture
async def tls_server(pki: Pki, tokens_file: str) -> AsyncIterator[KVCacheServer]:
    config = dataclasses.replace(
        SMALL_POOL,
        tls_cert_file=pki.path("server.pem"),
        tls_key_file=pki.path("server.key"),
        auth_tokens_file=tokens_file,
    )
    async with running_server(config) as server:
        yield server


@pytest.fixture
async def mtls_server(pki: Pki) -> AsyncIterator[KVCacheServer]:
    config = dataclasses.replace(
        SMALL_POOL,
        tls_cert_file=pki.path("server.pem"),
        tls_key_file=pki.path("server.key"),
        tls_client_ca_file=pki.path("ca.pem"),
    )
    async with running_server(config) as server:
        yield server


async def test_the_right_token_over_tls_is_accepted(tls_server: KVCacheServer, pki: Pki) -> None:
    target = tls_server.handle.target
    async with AsyncKVClient(target, token=TOKEN, root_certificates=pki.read("ca.pem")) as client:
        await client.add_request("over-tls", tokens(20))
        assert (await client.get_request("over-tls")).num_tokens == 20
    # TLS alone is not enough: the token is still required.
    async with AsyncKVClient(target, root_certificates=pki.read("ca.pem")) as anonymous:
        with pytest.raises(KVServiceError) as info:
            await anonymous.get_usage()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_plaintext_client_cannot_talk_to_a_tls_server(tls_server: KVCacheServer) -> None:
    async with AsyncKVClient(
        tls_server.handle.target, token=TOKEN, timeout=10, allow_insecure_token=True
    ) as client:
        with pytest.raises(KVServiceError) as info:
            await client.add_request("plain", tokens(4))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    tls_server.audit()
    assert tls_server.table.num_requests == 0


async def test_a_client_that_does_not_trust_the_server_is_refused(
    tls_server: KVCacheServer, pki: Pki
) -> None:
    roots = pki.read("rogue-ca.pem")
    async with AsyncKVClient(tls_server.handle.target, token=TOKEN, root_certificates=roots) as c:
        with pytest.raises(KVServiceError) as info:
            await c.get_usage()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_accepts_a_client_certificate_from_its_ca(
    mtls_server: KVCacheServer, pki: Pki
) -> None:
    async with AsyncKVClient(
        mtls_server.handle.target,
        root_certificates=pki.read("ca.pem"),
        certificate_chain=pki.read("client.pem"),
        private_key=pki.read("client.key"),
    ) as client:
        await client.add_request("mtls", tokens(3))
        assert (await client.get_usage()).num_requests == 1


@pytest.mark.parametrize("client_cert", [None, "rogue-client"])
async def test_mutual_tls_refuses_a_client_without_a_trusted_certificate(
    mtls_server: KVCacheServer, pki: Pki, client_cert: str | None
) -> None:
    chain = pki.read(f"{client_cert}.pem") if client_cert else None
    key = pki.read(f"{client_cert}.key") if client_cert else None
    async with AsyncKVClient(
        mtls_server.handle.target,
        root_certificates=pki.read("ca.pem"),
        certificate_chain=chain,
        private_key=key,
        timeout=10,
    ) as client:
        with pytest.raises(KVServiceError) as info:
            await client.add_request("no-cert", tokens(3))
        # The handshake fails, so gRPC reports the connection, not the call.
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.table.num_requests == 0


def test_tls_settings_that_cannot_work_fail_startup(pki: Pki, tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tls_cert_file": pki.path("server.pem")}, "tls_key_file"),
        ({"tls_client_ca_file": pki.path("ca.pem")}, "tls_client_ca_file"),
        (
            {"tls_cert_file": str(tmp_path / "missing.pem"), "tls_key_file": pki.path("ca.key")},
            "missing.pem",
        ),
    ]
    for fields, named in cases:
        with pytest.raises(SecurityConfigError, match=named):
            KVCacheServer(dataclasses.replace(SMALL_POOL, **fields))


# -- tokens file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ({}, "no tenants"),
        ({"tenants": {"a": {"tokens": ["short"]}}}, "at least 16"),
        ({"tenants": {"a": {"tokens": [TOKEN], "max_blocks": -1}}}, "max_blocks"),
        ({"tenants": {"a": {"tokens": [TOKEN], "rate_limit": 0}}}, "rate_limit"),
        ({"tenants": {"a": {"tokens": [TOKEN], "burst": 5}}}, "burst needs rate_limit"),
        ({"tenants": {"a": {"tokens": [TOKEN], "quota": 5}}}, "unknown keys"),
        ({"tenants": {"a": {"tokens": [TOKEN], "admin": "yes"}}}, "admin"),
        ({"tenants": {"a": {"tokens": [TOKEN]}, "b": {"tokens": [TOKEN]}}}, "unique"),
        ({"tenants": {"a\x00b": {"tokens": [TOKEN]}}}, "NUL"),
    ],
)
def test_a_bad_tokens_file_is_refused_without_revealing_tokens(
    document: dict[str, Any], problem: str
) -> None:
    with pytest.raises(SecurityConfigError, match=problem) as info:
        parse_tokens(document, "auth_tokens_file t.toml")
    assert TOKEN not in str(info.value)


def test_a_tokens_file_binds_each_token_to_its_tenant(tokens_file: str) -> None:
    table = load_tokens_file(tokens_file)
    team = table.authenticate(TOKEN)
    assert team is not None and team.name == "team" and not team.admin
    ops = table.authenticate(ADMIN_TOKEN)
    assert ops is not None and ops.admin
    assert table.authenticate(TOKEN + "x") is None
    assert table.authenticate("") is None


# -- bind safety and size limits --------------------------------------------------------


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "[::]", "10.0.0.1", "example.com", ""]))


def test_a_non_loopback_bind_without_protection_needs_the_flag(tokens_file: str) -> None:
    exposed = dataclasses.replace(SMALL_POOL, host="0.0.0.0")
    for config in (exposed, dataclasses.replace(exposed, auth_tokens_file=tokens_file)):
        with pytest.raises(SecurityConfigError, match="--allow-insecure-bind"):
            KVCacheServer(config)
    with structlog.testing.capture_logs() as logs:
        KVCacheServer(dataclasses.replace(exposed, allow_insecure_bind=True))
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["insecure bind"]


def test_a_non_loopback_bind_with_tls_and_tokens_needs_no_flag(pki: Pki, tokens_file: str) -> None:
    config = dataclasses.replace(
        SMALL_POOL,
        host="0.0.0.0",
        tls_cert_file=pki.path("server.pem"),
        tls_key_file=pki.path("server.key"),
        auth_tokens_file=tokens_file,
    )
    with structlog.testing.capture_logs() as logs:
        KVCacheServer(config)
    assert not [e for e in logs if e["log_level"] == "warning"]


async def test_the_cli_refuses_an_unprotected_public_bind() -> None:
    status, _, stderr = await run_kvservice("serve", "--host=0.0.0.0", "--port=0", "--no-metrics")
    assert status == 2
    assert "--allow-insecure-bind" in stderr


def test_serve_help_shows_the_security_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--tls-cert-file",
        "--tls-key-file",
        "--tls-client-ca-file",
        "--auth-tokens-file",
        "--allow-insecure-bind",
    ):
        assert flag in text


async def test_oversized_requests_are_refused(tokens_file: str) -> None:
    config = dataclasses.replace(
        SMALL_POOL, auth_tokens_file=tokens_file, max_message_bytes=64 * 1024
    )
    async with running_server(config) as server:
        async with grpc.aio.insecure_channel(server.handle.target) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)
            # Over the message limit: gRPC refuses the bytes before any handler.
            huge = pb.AddRequestRequest(request_id="huge", prompt_token_ids=[2**31] * 20_000)
            await refused(
                stub.AddRequest(huge, metadata=bearer(TOKEN)), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            # Under it but longer than max_model_len tokens: the request-size limit.
            long = pb.AddRequestRequest(
                request_id="long", prompt_token_ids=tokens(SMALL_POOL.max_model_len + 1)
            )
            error = await refused(
                stub.AddRequest(long, metadata=bearer(TOKEN)), grpc.StatusCode.OUT_OF_RANGE
            )
            assert "max_model_len" in (error.details() or "")
        assert server.table.num_requests == 0
