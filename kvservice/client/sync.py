"""The blocking client: the same methods as ``AsyncKVClient``, on a sync channel."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvservice.client import _wire
from kvservice.client.aio import (
    DEFAULT_TARGET,
    LEASE_LOST_CODES,
    RENEWALS_PER_TTL,
    RETRYABLE_CODES,
    audit_report,
    bearer_metadata,
    call_metadata,
    channel_credentials,
    check_token_channel,
    retry_delay,
    with_operation_id,
)
from kvservice.client.errors import KVServiceError, ServiceUnavailableError, error_from_rpc
from kvservice.client.events import EventStreamItem, StreamDecoder
from kvservice.client.step import (
    Handoff,
    PendingStep,
    StepBuilder,
    StepResults,
    StepSession,
)
from kvservice.client.step_socket import SocketSession
from kvservice.client.types import (
    AdmitOptions,
    AdmitResult,
    AllocateOptions,
    Allocation,
    AuditReport,
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    FreeResult,
    MultiModalFeature,
    Pin,
    PinList,
    ProbeOptions,
    ProbeResult,
    RequestState,
    Retention,
    Usage,
)
from kvservice.protocol import SESSION_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc

T = TypeVar("T")


class KVClient:
    """A blocking connection to one kvservice server; see ``AsyncKVClient`` (the
    same ``retries`` and ``open_session``; the lease is renewed by a daemon thread)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        client_id: str | None = None,
        timeout: float | None = 30.0,
        retries: int = 0,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        allow_insecure_token: bool = False,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        credentials = channel_credentials(tls, root_certificates, certificate_chain, private_key)
        check_token_channel(target, token, credentials, allow_insecure_token)
        self.target = target  # the server's address, as given
        self._channel = (
            grpc.insecure_channel(target)
            if credentials is None
            else grpc.secure_channel(target, credentials)
        )
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self._base_metadata = call_metadata(client_id) + bearer_metadata(token)
        self._metadata = self._base_metadata
        self._timeout = timeout
        self._retries = retries
        self._step_ids = itertools.count(1)
        # The session this client's calls run under (``open_session``), if any.
        self._lease: Lease | None = None

    def __enter__(self) -> KVClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; an open session is left to run out (see
        ``AsyncKVClient.close``)."""
        if self._lease is not None:
            self._lease.stop_renewing()
        self._channel.close()

    def _call(self, op: _wire.Op[T]) -> T:
        return op.parse(self._invoke(op.rpc, op.message))

    def _invoke(self, rpc: str, message: Any) -> Any:
        """One unary call, retried (with one operation id) when ``retries`` allows."""
        method = getattr(self._stub, rpc)
        metadata = with_operation_id(self._metadata, rpc, self._retries)
        attempt = 0
        while True:
            try:
                return method(message, metadata=metadata, timeout=self._timeout)
            except grpc.RpcError as err:
                if attempt >= self._retries or err.code() not in RETRYABLE_CODES:
                    raise error_from_rpc(err) from None
            time.sleep(retry_delay(attempt))
            attempt += 1

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        prompt_embeds: bytes | bytearray | memoryview | None = None,
        prompt_embeds_row_bytes: int = 0,
        retention: Retention | None = None,
        cache_control_ttl: str | float | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> RequestState:
        """Register a WAITING request with its prompt. A LoRA adapter is keyed by
        ``lora_name`` and ``lora_path`` (vLLM's ``lora_request``), ``lora_int_id``
        labels its KV events; ``prompt_embeds`` are the raw bytes of a row-major
        ``[num_prompt_tokens, hidden]`` tensor, ``prompt_embeds_row_bytes`` per row (for
        a torch tensor ``t``: ``t.contiguous().view(torch.uint8).numpy().tobytes()``
        and ``t[0].numel() * t.element_size()``). ``retention`` gives its blocks
        eviction priorities (a server started with ``--eviction-policy priority``);
        ``cache_control_ttl`` ("5m", "300s", "1h", or seconds) pins its prompt's whole
        blocks for the caller's tenant for that long, created with the request.
        ``block_hashes`` (a server that trusts the caller's hashes only:
        ``CacheConfig.trusts_client_block_hashes``) makes the request client_hashed:
        the server takes these hashes of the prompt's full blocks, and those that
        ``append_tokens`` sends, instead of hashing its tokens."""
        op = _wire.add_request(
            request_id,
            prompt_token_ids,
            cache_salt,
            lora_name,
            mm_features,
            skip_reading_prefix_cache,
            lora_path,
            lora_int_id,
            prompt_embeds,
            prompt_embeds_row_bytes,
            retention,
            cache_control_ttl,
            block_hashes,
        )
        return self._call(op)

    def append_tokens(
        self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
    ) -> RequestState:
        """Append sampled tokens (for a client_hashed request, with the hashes of the
        blocks they complete)."""
        return self._call(_wire.append_tokens(request_id, token_ids, block_hashes))

    def get_computed_blocks(
        self, request_id: str, max_cache_hit_length: int | None = None
    ) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request (pass it as ``hit``), at
        most ``max_cache_hit_length`` tokens."""
        return self._call(_wire.get_computed_blocks(request_id, max_cache_hit_length))

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> Allocation | None:
        """vLLM's allocate_slots; None when there is no room (nothing changed)."""
        return self._call(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions | None = None,
    ) -> AdmitResult:
        """Admit waiting requests in order within ``token_budget``, as vLLM's
        scheduler does: for each, the prefix lookup, its share of the budget, then
        allocate_slots with the hit; stops at the first that does not fit (see
        ``AdmitResult.stop_reason``). One call for what takes two per request."""
        return self._call(_wire.admit(request_ids, token_budget, options))

    def free(self, request_id: str, mode: FreeMode = FreeMode.FINISH) -> FreeResult:
        """Release the request's blocks; PREEMPT keeps it for re-prefill."""
        return self._call(_wire.free(request_id, mode))

    def probe(
        self,
        request_id: str,
        num_new_tokens: int | None = None,
        options: ProbeOptions | None = None,
    ) -> ProbeResult:
        """What a lookup plus allocate_slots would do now; changes nothing."""
        return self._call(_wire.probe(request_id, num_new_tokens, options))

    def get_request(self, request_id: str) -> RequestState:
        return self._call(_wire.get_request(request_id))

    def get_block_ids(self, request_id: str) -> BlockIds:
        return self._call(_wire.get_block_ids(request_id))

    def get_usage(self, pool_wide: bool = False) -> Usage:
        """The caller's tenant's usage (see ``Usage``); ``pool_wide``: every tenant's
        together (admin tenants only, else ``PermissionDeniedError``)."""
        return self._call(_wire.get_usage(pool_wide))

    def reset_prefix_cache(self, *, fresh_pool: bool = False) -> bool:
        """Forget every cached prefix; False while blocks are in use. ``fresh_pool``
        also puts the free blocks back in a new pool's order."""
        return self._call(_wire.reset_prefix_cache(fresh_pool))

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM's ``new_step_starts``), before the step's
        lookups, allocations and ``admit``: a Mamba state cached from now on is
        refused as a prefix hit until the next one."""
        return self._call(_wire.new_step_starts())

    def free_retained_blocks(self, block_ids: Sequence[int]) -> int:
        """Release copy holds this client's session kept (a step sent with
        ``keep_copy_holds``), in the order given; the pool's free blocks after."""
        return self._call(_wire.free_retained_blocks(block_ids))

    def cache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """vLLM's ``cache_blocks``: hash into the prefix cache the request's blocks
        its first ``num_computed_tokens`` tokens fill (monotonic, idempotent)."""
        return self._call(_wire.cache_blocks(request_id, num_computed_tokens))

    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        ttl_s: float | None = None,
        refresh_on_hit: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        block_hashes: Sequence[bytes] = (),
    ) -> Pin:
        """Pin the whole blocks of ``token_ids`` for the caller's tenant (for ``ttl_s``
        seconds, restarted by each hit with ``refresh_on_hit``; None: until unpinned).
        Blocks not cached yet join the pin when cached; pinning the same prefix again
        refreshes the pin. ``cache_salt``, ``lora_name`` and ``lora_path`` must be the
        requests' for the pin to match them. ``block_hashes``: a tenant trusted with
        client block hashes pins the blocks of its ``client_hashed`` requests by their
        hashes, one per whole block of ``token_ids`` (the server hashes the tokens
        otherwise). ``ResourceExhaustedError`` past the pool's pinned budget or with
        pinning off."""
        op = _wire.pin_prefix(
            token_ids, ttl_s, refresh_on_hit, cache_salt, lora_name, lora_path, block_hashes
        )
        return self._call(op)

    def unpin_prefix(self, pin_id: str) -> None:
        """Drop one of the caller's tenant's pins; ``RequestNotFoundError`` (NOT_FOUND)
        when it has no such pin."""
        return self._call(_wire.unpin_prefix(pin_id))

    def list_pins(self, *, all_tenants: bool = False) -> PinList:
        """The caller's tenant's pins and the pool's pinned budget (``all_tenants``:
        every tenant's, for an admin tenant or a server without tenants)."""
        return self._call(_wire.list_pins(all_tenants))

    def get_cache_config(self) -> CacheConfig:
        return self._call(_wire.get_cache_config())

    def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Run the builder's operations as one ``Step`` call."""
        request = builder.to_pb(next(self._step_ids), stop_on_error)
        return StepResults(self._invoke("Step", request))

    def start_step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StartedStep:
        """Start one ``Step`` call without waiting for its results: ``result()`` waits
        (or raises the call's typed error). Steps started together are not ordered."""
        request = builder.to_pb(next(self._step_ids), stop_on_error)
        return StartedStep(
            self._stub.Step.future(request, metadata=self._metadata, timeout=self._timeout)
        )

    def start_offload_step(self, request: pb.OffloadStepRequest) -> StartedOffloadStep:
        """Start one ``OffloadStep`` (a CPU offload tier's step, built by
        ``kvservice.client.offload_link``) without waiting: ``result()`` waits
        for it, or raises the call's typed error. Under this client's session only."""
        return StartedOffloadStep(
            self._stub.OffloadStep.future(request, metadata=self._metadata, timeout=self._timeout)
        )

    def audit(self) -> AuditReport:
        """Have the server check every invariant of its pool (O(pool size))."""
        return audit_report(self._invoke("Audit", pb.AuditRequest()))

    def open_session(
        self, ttl_s: float = 0.0, *, epoch: int = 0, client_name: str = "", replica: bool = False
    ) -> Lease:
        """Open a server session bound to this client; see
        ``AsyncKVClient.open_session``."""
        response = self._invoke(
            "OpenSession",
            pb.OpenSessionRequest(
                ttl_seconds=ttl_s, client_name=client_name, epoch=epoch, replica=replica
            ),
        )
        if self._lease is not None:
            self._lease.stop_renewing()
        self._metadata = (*self._base_metadata, (SESSION_KEY, response.session_id))
        self._lease = Lease(self, response.session_id, epoch, response.ttl_seconds)
        self._lease.start()
        return self._lease

    def _keep_alive(self, session_id: str) -> None:
        self._invoke("KeepAlive", pb.KeepAliveRequest(session_id=session_id))

    def _close_session(self, session_id: str, free_requests: bool) -> int:
        if self._lease is not None and self._lease.session_id == session_id:
            self._metadata, self._lease = self._base_metadata, None
        response = self._invoke(
            "CloseSession",
            pb.CloseSessionRequest(session_id=session_id, free_requests=free_requests),
        )
        freed: int = response.num_requests_freed
        return freed

    def subscribe_events(
        self, from_sequence: int = 0, log_id: str = ""
    ) -> Generator[EventStreamItem, None, None]:
        """The server's KV events, as ``AsyncKVClient.subscribe_events``; closing the
        generator cancels the stream."""
        call = self._stub.SubscribeEvents(
            pb.SubscribeEventsRequest(from_sequence=from_sequence, log_id=log_id),
            metadata=self._metadata,
        )
        decoder = StreamDecoder()
        try:
            for message in call:
                item = decoder.feed(message)
                if item is not None:
                    yield item
        except grpc.RpcError as err:
            raise error_from_rpc(err, subscription=True) from None
        finally:
            call.cancel()

    def session(self) -> Session:
        """One ``StepStream`` (``with client.session() as s``); not a server session,
        which ``open_session`` opens."""
        return Session(self._channel, self._metadata)

    def socket_session(self, path: str, *, write_thread: bool = False) -> SocketSession:
        """One StepStream on the server's step socket at ``path`` (``kvservice serve
        --step-socket``, same node): ``session()`` without gRPC, under this client's
        token and session. ``write_thread``: see ``SocketSession``."""
        return SocketSession(path, self._metadata, self._timeout, write_thread=write_thread)


_CLOSE = None  # put on the outbound queue to half-close the stream
_STEP_STREAM = "/kvservice.v1.KVCacheService/StepStream"


class StartedStep:
    """A ``Step`` call on its way (``KVClient.start_step``)."""

    __slots__ = ("_future", "_results")

    def __init__(self, future: Any) -> None:
        self._future = future
        self._results: StepResults | None = None

    def result(self) -> StepResults:
        if self._results is None:
            try:
                self._results = StepResults(self._future.result())
            except grpc.RpcError as err:
                raise error_from_rpc(err) from None
        return self._results


class StartedOffloadStep:
    """An ``OffloadStep`` call on its way (``KVClient.start_offload_step``)."""

    __slots__ = ("_future",)

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self) -> pb.OffloadStepResponse:
        try:
            response: pb.OffloadStepResponse = self._future.result()
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return response


class Session(StepSession):
    """One long-lived ``StepStream`` on the blocking API; see ``AsyncSession``. (A
    server session, the lease that owns requests, is a ``Lease``.)

    Not thread safe: one thread drives a session.
    """

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        # Messages travel serialized: this thread encodes them, so gRPC's sending
        # thread (which pulls them from ``_messages``) has little to do with the GIL.
        self._outbound: Handoff[bytes | None] = Handoff()
        call = channel.stream_stream(
            _STEP_STREAM,
            request_serializer=None,
            response_deserializer=pb.StepStreamResponse.FromString,
        )
        # An iterator of answers that is also the call (done(), cancel()).
        self._responses: Any = call(self._messages(), metadata=metadata)
        self._step_ids = itertools.count(1)
        # Steps sent whose answers are not read yet, oldest first (answers come in order).
        self._unread: collections.deque[PendingStep] = collections.deque()

    def _messages(self) -> Iterator[bytes]:
        while (message := self._outbound.get()) is not _CLOSE:
            yield message

    def send(self, builder: StepBuilder, *, stop_on_error: bool = False) -> PendingStep:
        """Send one step without waiting for its results: the server runs it while
        this thread goes on (a scheduler builds its next operations meanwhile). Steps
        run in the order sent; ``result()`` waits for this one's answer."""
        message = builder.to_stream_pb(next(self._step_ids), stop_on_error)
        # No wait once the call is over: gRPC's thread takes nothing more.
        self._outbound.put(message.SerializeToString(), wait=not self._responses.done())
        pending = PendingStep(self._read_through)
        self._unread.append(pending)
        return pending

    def _read_through(self, pending: PendingStep) -> None:
        """Read answers, oldest first, until ``pending``'s."""
        while not pending.done():
            oldest = self._unread.popleft()
            try:
                oldest.resolve(StepResults(next(self._responses).step))
            except grpc.RpcError as err:
                oldest.resolve_error(error_from_rpc(err))
            except StopIteration:
                oldest.resolve_error(
                    ServiceUnavailableError(grpc.StatusCode.UNAVAILABLE, "the stream ended")
                )

    def close(self) -> None:
        """Read the answers of the steps sent and not yet read (into their
        ``PendingStep``), half-close, and wait for the server to end the stream."""
        if self._unread:
            self._read_through(self._unread[-1])
        self._outbound.put(_CLOSE, wait=False)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    def cancel(self) -> None:
        """Drop the stream at once."""
        self._outbound.put(_CLOSE, wait=False)
        self._responses.cancel()


class Lease:
    """An open server session on the blocking API (``KVClient.open_session``): a
    daemon thread renews the lease every third of its TTL; see ``AsyncLease``."""

    def __init__(self, client: KVClient, session_id: str, epoch: int, ttl_s: float) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self.ttl_s = ttl_s
        self.lost: KVServiceError | None = None
        self._client = client
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._renew, name=f"kvservice-lease-{session_id[:8]}", daemon=True
        )

    def __repr__(self) -> str:
        return f"Lease(session_id={self.session_id!r}, epoch={self.epoch}, ttl_s={self.ttl_s})"

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _renew(self) -> None:
        while not self._stopping.wait(self.ttl_s / RENEWALS_PER_TTL):
            try:
                self._client._keep_alive(self.session_id)
            except KVServiceError as err:
                if err.code in LEASE_LOST_CODES:
                    self.lost = err
                    return

    def stop_renewing(self) -> None:
        """Stop the background renewal (the lease then runs out on the server)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def close(self, free_requests: bool = True) -> int:
        """Stop renewing and end the session; see ``AsyncLease.close``."""
        self.stop_renewing()
        return self._client._close_session(self.session_id, free_requests)
