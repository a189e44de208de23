"""Assembling and running the server: gRPC service, health, reflection, metrics.

Public API: ``KVCacheServer`` (``start`` / ``stop``), ``serve_in_background`` (an
async context manager for tests and embedding) and ``serve`` (runs until SIGTERM or
SIGINT; what ``kvservice serve`` calls).
"""

from __future__ import annotations

import asyncio
import gc
import math
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice.core.errors import InvalidArgumentError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.server import binding
from kvservice.server.audit import Auditor, SelfCheck
from kvservice.server.auth import AuthInterceptor, TokenTable, load_tokens_file
from kvservice.server.caller import CallerLayer
from kvservice.server.config import (
    ServerConfig,
    build_kv_cache_config,
    build_manager,
    hash_seed_source,
)
from kvservice.server.drain import Drain
from kvservice.server.events import EventLog
from kvservice.server.idempotency import IdempotencyLayer, OperationCache
from kvservice.server.interceptors import BoundaryInterceptor, RpcLayer
from kvservice.server.log import unfiltered_logger
from kvservice.server.loop_watch import STALL_INTERVAL_S, FullCollections, GcWatch, StallWatch
from kvservice.server.metrics import (
    ClientTracker,
    KVCacheMetrics,
    MetricsEndpoint,
    RetentionSource,
)
from kvservice.server.offload_tiers import OffloadTiers
from kvservice.server.probes import LoopProbe
from kvservice.server.runtime import build_runtime, kv_cache_budget
from kvservice.server.servicer import KVCacheServicer
from kvservice.server.sessions import (
    SessionLayer,
    SessionPolicy,
    SessionReaper,
    SessionRegistry,
)
from kvservice.server.step_socket import StepSocket
from kvservice.server.tls import (
    SecurityConfigError,
    check_bind,
    check_step_socket,
    server_credentials,
)
from kvservice.server.turns import TableTurn
from kvservice.server.zmq_events.publisher import ZmqEventPublisher

if TYPE_CHECKING:  # only for annotations: importing gpu_runtime imports torch
    from gpu_runtime.runtime import KVCacheRuntime

log = structlog.get_logger("kvservice.server")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name


def _channel_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        # The default (1) would let a second server bind the same port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Schedulers hold one long-lived channel; let them keep it alive when idle.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def _step_stream_handler(servicer: KVCacheServicer) -> Any:
    """The servicer's StepStream as the generated code registers it with gRPC."""
    return grpc.stream_stream_rpc_method_handler(
        servicer.StepStream,
        request_deserializer=pb.StepStreamRequest.FromString,
        response_serializer=pb.StepStreamResponse.SerializeToString,
    )


# Seconds grpc is given, after the drain, to send the statuses of calls that ended.
_STATUS_FLUSH_S = 0.5


@dataclass(frozen=True, slots=True)
class ServerHandle:
    """Where a started server listens, and its KV tensors when it owns them.

    ``runtime`` is the co-located runtime (``--runtime torch``), None without one. It
    is for co-located use only (a model running in the server's own process, tests):
    read and write its tensors only from the loop the server runs on, between RPCs, at
    the block ids the answers give. Fresh blocks already read as zeros when an answer
    arrives; the server touches nothing else.
    """

    host: str
    port: int
    metrics_port: int | None
    runtime: KVCacheRuntime | None = None
    # Where the HTTP endpoint listens; None: the gRPC host.
    metrics_host: str | None = None

    @property
    def target(self) -> str:
        """The address to give ``grpc.aio.insecure_channel`` (``[::1]:port`` for IPv6)."""
        return binding.address(self.host, self.port)

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return (
            f"http://{binding.address(self.metrics_host or self.host, self.metrics_port)}/metrics"
        )


class KVCacheServer:
    """One pool served over gRPC, with health, reflection and a metrics endpoint.

    ``table`` (the request table) is public for embedding and tests: touch it only
    from the loop the server runs on (it is not thread safe), e.g. ``server.audit()``
    after a test.
    ``runtime`` (also on the handle) holds the KV tensors with ``runtime="torch"``,
    else None; it is allocated here, before the server binds, so a device or memory
    problem fails startup. ``events`` is the KV event log behind ``SubscribeEvents``
    when the pool records events, else None; ``kv_event_publisher`` publishes it on
    ZMQ as vLLM does with a ``kv_events_config`` that asks for it, else None.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Security settings first: a bad file or an unsafe bind fails startup before
        # anything is allocated. ``tokens`` is None without a tokens file.
        self.tokens: TokenTable | None = (
            load_tokens_file(config.auth_tokens_file) if config.auth_tokens_file else None
        )
        self._credentials = server_credentials(config)
        check_bind(config, has_tokens=self.tokens is not None)
        check_step_socket(config, has_tokens=self.tokens is not None)
        trusted_hash_tenants = self._trusted_hash_tenants()
        kv_cache_config = build_kv_cache_config(config, kv_cache_budget(config))
        manager = build_manager(config, kv_cache_config)
        self.runtime: KVCacheRuntime | None = (
            build_runtime(config, kv_cache_config) if config.has_runtime else None
        )
        self.metrics = KVCacheMetrics(manager, config.model_name, config.engine)
        self.events: EventLog | None = (
            EventLog(
                manager,
                config.kv_events_buffer_size,
                config.kv_events_queue_size,
                published=self.metrics.events_published,
                dropped=self.metrics.events_dropped,
            )
            if config.records_kv_events
            else None
        )
        self.kv_event_publisher = self._zmq_publisher()
        self.table = RequestTable(
            manager,
            self.metrics,
            self.runtime,
            events=self.events.publish if self.events is not None else None,
            quotas=self.tokens.quotas if self.tokens is not None else None,
            on_refusal=self.metrics.record_refusal,
            vocab_size=config.vocab_size,
            limits=config.request_limits,
            trusted_hash_tenants=trusted_hash_tenants,
        )
        self.clients = ClientTracker()
        # Sessions own requests (the registry hooks into the table); the reaper
        # and the self-check run on the server's loop between start and stop.
        # Whose turn it is on the table (``turns``): a large Step pauses holding it;
        # a session's end frees what it owns in it.
        self.turn = TableTurn()
        self.sessions = SessionRegistry(
            self.table, SessionPolicy.of(config), self.metrics, turn=self.turn
        )
        # The engines' CPU offload tier indexes, each dropped with its session.
        self.offload_tiers = OffloadTiers(
            config.max_step_ops,
            self.events.publish if self.events is not None else None,
            self.metrics,
        )
        self.sessions.end_listeners.append(self.offload_tiers.session_ended)
        self.auditor = Auditor(self.table, self.sessions, self.metrics, turn=self.turn)
        self._operations = OperationCache(config.idempotency_cache_size)
        self._reaper = SessionReaper(self.sessions, turn=self.turn)
        self._self_check = (
            SelfCheck(self.auditor, config.audit_interval_s) if config.audit_interval_s else None
        )
        self.metrics.watch(manager, lambda: self.table.num_requests, self.clients)
        self.metrics.watch_tenants(self.table.tenant_blocks)
        self.metrics.watch_tenant_requests(self.table.requests_per_tenant.per_tenant)
        self.metrics.watch_tenant_sessions(self.sessions.tenant_sessions)
        retention = manager.retention_policy
        self.metrics.watch_retention(
            RetentionSource(
                budget=self.table.pinned_budget,
                pins_per_tenant=self.table.pins_per_tenant,
                stats=lambda: retention.stats if retention is not None else None,
            )
        )
        # How long the loop is held up (``loop_watch``): reported in the metrics, and
        # the longest figures kept for tests and benchmarks.
        if not (config.loop_stall_interval_s >= 0 and math.isfinite(config.loop_stall_interval_s)):
            raise InvalidArgumentError(
                f"loop_stall_interval must be finite seconds >= 0 (0: no stall watch), got "
                f"{config.loop_stall_interval_s}"
            )
        # Built even when off (0): never started then, its figures stay 0 for the
        # benchmarks and tests that read them.
        self.stalls = StallWatch(
            config.loop_stall_interval_s or STALL_INTERVAL_S, self.metrics.record_loop_stall
        )
        self.collections = GcWatch(
            observe=self.metrics.record_gc_pause, inside=lambda: self.turn.taken
        )
        if config.gc_full_collection_interval_s < 0:
            raise InvalidArgumentError(
                f"gc_full_collection_interval must be >= 0 (0: Python's own full "
                f"collections), got {config.gc_full_collection_interval_s}"
            )
        self._full_collections = (
            FullCollections(config.gc_full_collection_interval_s, self.turn.run)
            if config.gc_full_collection_interval_s
            else None
        )
        self._health = health.aio.HealthServicer()
        self._server: Any = None
        self._step_socket: StepSocket | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._handle: ServerHandle | None = None
        self._drain = Drain()
        # Started and not stopped (what /ready reports, with the drain).
        self._taking_calls = False

    def _trusted_hash_tenants(self) -> frozenset[str]:
        """Whose block hashes the pool takes: the default tenant's with the flag and no
        tokens file, else the tenants the file trusts (the flag would name no one)."""
        if self.tokens is None:
            return (
                frozenset({DEFAULT_TENANT})
                if self.config.trust_client_block_hashes
                else frozenset()
            )
        if self.config.trust_client_block_hashes:
            raise SecurityConfigError(
                "--trust-client-block-hashes trusts the default tenant, which a server "
                "with a tokens file does not have: set trust_client_block_hashes = true "
                "in the tables of the tenants to trust instead"
            )
        return self.tokens.trusted_hash_tenants

    def _zmq_publisher(self) -> ZmqEventPublisher | None:
        config = self.config
        if self.events is None or not config.kv_events_config.publishes:
            if config.kv_events_config.publisher == "zmq":
                log.warning("kv_events_config asks for zmq without enable_kv_cache_events")
            return None
        publisher = ZmqEventPublisher(
            config.kv_events_config,
            self.metrics,
            bind_host=config.kv_events_bind_host,
            allow_insecure_bind=config.allow_insecure_bind,
            int_block_hashes=config.kv_events_int_block_hashes,
        )
        self.events.add_listener(publisher.collect)
        return publisher

    @property
    def handle(self) -> ServerHandle:
        if self._handle is None:
            raise RuntimeError("the server is not started")
        return self._handle

    async def start(self) -> ServerHandle:
        """Bind, start serving and report SERVING; returns where it listens.
        ``BindError`` (nothing started) for an address that cannot be bound."""
        config = self.config
        # Before gRPC's server exists: it would say only "Failed to bind".
        binding.check_bindable(config.host, config.port, "--host/--port")
        if config.metrics_port is not None:
            binding.check_bindable(
                config.metrics_host, config.metrics_port, "--metrics-host/--metrics-port"
            )
        # Outermost first: RpcLayer turns the inner ones' refusals into statuses;
        # sessions resolve the caller before idempotency scopes operation ids by it;
        # CallerLayer hands the caller to the servicer's methods.
        interceptors: list[Any] = [
            BoundaryInterceptor(
                SERVICE_NAME,
                [
                    RpcLayer(self.metrics, self.clients, self._drain),
                    SessionLayer(self.sessions),
                    IdempotencyLayer(self._operations, self.metrics),
                    CallerLayer(),
                ],
            )
        ]
        if self.tokens is not None:
            # Before all others: it sets the tenant they read, and a call it refuses
            # reaches none of them, so it changes nothing.
            interceptors.insert(
                0,
                AuthInterceptor(
                    self.tokens,
                    self.metrics.record_refusal,
                    on_delay=self.metrics.record_rate_delay,
                ),
            )
        server = grpc.aio.server(interceptors=interceptors, options=_channel_options(config))
        # Registered as grpc's generated servicer, though its methods take the caller as
        # a third argument: the boundary's CallerLayer, always installed above, passes it.
        servicer = KVCacheServicer(
            self.table,
            config.model_name,
            config.max_step_ops,
            runtime_device=config.device if self.runtime is not None else "",
            events=self.events,
            sessions=self.sessions,
            auditor=self.auditor,
            turn=self.turn,
            seed_source=hash_seed_source(config),
            offload_tiers=self.offload_tiers,
        )
        pb_grpc.add_KVCacheServiceServicer_to_server(
            cast("pb_grpc.KVCacheServiceServicer", servicer), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = binding.address(config.host, config.port)
        try:
            port = (
                server.add_secure_port(address, self._credentials)
                if self._credentials is not None
                else server.add_insecure_port(address)
            )
        except RuntimeError as err:  # taken since the check: a race
            raise binding.BindError(f"gRPC cannot listen on {address}: {err}") from None
        if config.unix_socket:
            self._listen_on_unix_socket(server, config.unix_socket)
        if config.step_socket:
            self._step_socket = StepSocket(
                config.step_socket,
                interceptors,
                _step_stream_handler(servicer),
                config.max_message_bytes,
                on_connect=self.metrics.step_socket_connections.inc,
            )
            await self._step_socket.start()
        if self.kv_event_publisher is not None:
            # Before the first call, whose events it must not miss.
            self.kv_event_publisher.start()
        await server.start()
        self._server = server
        try:
            metrics_port = self._start_metrics()
        except binding.BindError:
            await self.stop(grace=0)
            raise
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper.start()
        if self._self_check is not None:
            self._self_check.start()
        if config.loop_stall_interval_s:
            self.stalls.start()
        self.collections.start()
        if self._full_collections is not None:
            self._full_collections.start()
        self._handle = ServerHandle(
            config.host, port, metrics_port, self.runtime, config.metrics_host
        )
        self._taking_calls = True
        return self._handle

    def _listen_on_unix_socket(self, server: Any, path: str) -> None:
        """Serve on ``path`` too (``unix:PATH``), replacing a socket file a previous
        server left (gRPC would refuse to bind it); anything else there is an error."""
        binding.remove_stale_socket(path, "--unix-socket")
        target = f"unix:{path}"
        try:
            if self._credentials is not None:
                server.add_secure_port(target, self._credentials)
            else:
                server.add_insecure_port(target)
        except RuntimeError as err:
            raise binding.BindError(f"gRPC cannot listen on {target}: {err}") from None

    def _start_metrics(self) -> int | None:
        """The HTTP endpoint: /metrics, and /health and /ready answered from the loop."""
        config = self.config
        if config.metrics_port is None:
            return None
        probe = LoopProbe(
            asyncio.get_running_loop(), lambda: self._taking_calls and not self._drain.draining
        )
        self._metrics_endpoint = MetricsEndpoint.start(
            self.metrics.registry, config.metrics_host, config.metrics_port, probe
        )
        return self._metrics_endpoint.port

    @property
    def security(self) -> dict[str, str | int | None]:
        """What the startup line says of TLS and authentication."""
        config = self.config
        tls = "off" if config.tls_cert_file is None else "tls"
        if config.tls_client_ca_file is not None:
            tls = "mtls"
        tokens = self.tokens
        return {
            "tls": tls,
            "auth": "off" if tokens is None else "tokens",
            "tenants": None if tokens is None else len(tokens.tenants),
        }

    def audit(self) -> None:
        """Check the pool's invariants and that every block table belongs to a known
        request; raises ``InvariantViolationError``. O(pool size)."""
        self.table.audit()

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls with UNAVAILABLE, let the calls and
        streams already in a handler finish for up to ``grace`` seconds (the config's by
        default), then stop grpc and close the metrics endpoint. Idempotent."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        self._taking_calls = False
        await self._health.enter_graceful_shutdown()
        await self._reaper.stop()
        if self._self_check is not None:
            await self._self_check.stop()
        if self._server is not None:
            self._drain.begin()
            if not await self._drain.wait_idle(grace):
                log.warning("grace period over; cancelling the calls still running", grace_s=grace)
            # Whatever is left (health watches, reflection, calls past the grace) is
            # cancelled; see kvservice/server/drain.py for why grpc's grace is not used
            # for the drain. A short one still lets calls whose handler has just
            # returned send their status: a stream closed a moment before the drain
            # ended was otherwise seen cancelled now and then (test_faults' SIGTERM
            # test, under load).
            await self._server.stop(_STATUS_FLUSH_S)
            self._server = None
        if self._step_socket is not None:
            # After the drain, as gRPC: the streams left past the grace are cancelled.
            await self._step_socket.stop()
            self._step_socket = None
        # Sessions still being ended (their last frees), then the watches.
        await self.turn.drain()
        await self.stalls.stop()
        self.collections.stop()
        if self._full_collections is not None:
            await self._full_collections.stop()
        # After the calls: an Audit still running past the grace has its child killed.
        await self.auditor.close()
        if self.kv_event_publisher is not None:
            # After gRPC: the last calls' events go out too.
            await self.kv_event_publisher.stop()
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.stop()
            self._metrics_endpoint = None


@asynccontextmanager
async def serve_in_background(config: ServerConfig) -> AsyncIterator[ServerHandle]:
    """Run a server for the duration of the block; ``port=0`` binds a free port::

    async with serve_in_background(ServerConfig(port=0, metrics_port=None)) as h:
        async with grpc.aio.insecure_channel(h.target) as channel:
            ...
    """
    server = KVCacheServer(config)
    handle = await server.start()
    try:
        yield handle
    finally:
        await server.stop(grace=0)


async def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    server = KVCacheServer(config)
    # As vLLM does after startup: move the pool's blocks (one object each, millions for
    # a large pool) out of the collector's reach, so no collection rescans them.
    gc.collect()
    gc.freeze()
    handle = await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stopping.set)
    # Written at any log level: with --port 0 it is the only way to learn the port.
    unfiltered_logger().info(
        "serving",
        address=handle.target,
        port=handle.port,
        unix_socket=f"unix:{config.unix_socket}" if config.unix_socket else None,
        step_socket=config.step_socket or None,
        metrics_url=handle.metrics_url,
        # The pool's, not the setting's: a memory budget may have sized it.
        num_blocks=server.table.manager.kv_cache_config.num_blocks,
        block_size=config.block_size,
        runtime=config.runtime,
        device=config.device if server.runtime is not None else None,
        max_model_len=config.max_model_len,
        **server.security,
    )
    try:
        await stopping.wait()
        log.info("shutting down", grace_s=config.shutdown_grace_s)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.stop()
    log.info("stopped")
