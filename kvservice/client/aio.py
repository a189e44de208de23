"""The asyncio client: one channel, typed methods, batched steps and stream sessions."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvservice.client import _wire
from kvservice.client.errors import (
    InsecureTokenError,
    KVServiceError,
    error_for,
    error_from_rpc,
)
from kvservice.client.events import EventStreamItem, StreamDecoder
from kvservice.client.step import StepAnswer, StepBuilder, StepResults
from kvservice.client.step_socket import SocketCall
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
from kvservice.protocol import (
    AUTHORIZATION_KEY,
    CLIENT_ID_KEY,
    MUTATING_UNARY_METHODS,
    OPERATION_ID_KEY,
    SESSION_KEY,
)
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc

T = TypeVar("T")
DEFAULT_TARGET = "127.0.0.1:50051"


Metadata = tuple[tuple[str, str], ...]
# Failures after which the call may or may not have run: retried with the same id.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
RETRY_BACKOFF_S = 0.05
# A lease is renewed this many times per TTL, so one lost KeepAlive does not end it.
RENEWALS_PER_TTL = 3
# Answers to KeepAlive after which renewing again is pointless.
LEASE_LOST_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})


def call_metadata(client_id: str | None) -> Metadata:
    """The metadata sent with every call: ``x-client-id`` names the scheduler."""
    return ((CLIENT_ID_KEY, client_id),) if client_id else ()


def bearer_metadata(token: str | None) -> Metadata:
    """``authorization: Bearer <token>`` for a server with a tokens file; sent with
    every call, streams included. Over plaintext only on loopback: use TLS elsewhere."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def channel_credentials(
    tls: bool,
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> Any:
    """``grpc.ChannelCredentials`` for TLS, or None for plaintext. TLS is on with
    ``tls`` or any PEM given: ``root_certificates`` checks the server (the system's
    roots when None); ``certificate_chain`` and ``private_key`` (together) are the
    client's own certificate for a server that requires mutual TLS."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("certificate_chain and private_key go together (mutual TLS)")
    if not tls and root_certificates is None and certificate_chain is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def check_token_channel(
    target: str, token: str | None, credentials: Any, allow_insecure_token: bool
) -> None:
    """Raise ``InsecureTokenError`` for a token about to travel in plaintext unless
    ``allow_insecure_token`` says so (never naming the token)."""
    if token and credentials is None and not allow_insecure_token:
        raise InsecureTokenError(
            f"refusing to send a bearer token to {target} over a plaintext channel, where "
            f"anyone on the path could read it: turn TLS on (root_certificates=<the "
            f"server's CA, PEM> or tls=True for the system roots), or pass "
            f"allow_insecure_token=True to send it anyway (a loopback server without TLS)"
        )


def with_operation_id(metadata: Metadata, rpc: str, retries: int) -> Metadata:
    """``metadata`` plus a fresh operation id for a mutating call when retries are on
    (the id is the same on every attempt of the call)."""
    # With retries on, each mutating call carries an operation id, so the server
    # applies a retried one once.
    if retries and rpc in MUTATING_UNARY_METHODS:
        return (*metadata, (OPERATION_ID_KEY, uuid.uuid4().hex))
    return metadata


def retry_delay(attempt: int) -> float:
    """Exponential backoff before retry ``attempt`` (0-based)."""
    delay: float = RETRY_BACKOFF_S * 2**attempt
    return delay


def audit_report(msg: pb.AuditResponse) -> AuditReport:
    return AuditReport(
        ok=msg.ok,
        violations=tuple(msg.violations),
        num_free_blocks=msg.num_free_blocks,
        num_held_blocks=msg.num_held_blocks,
        num_cached_blocks=msg.num_cached_blocks,
        num_requests=msg.num_requests,
        num_sessions=msg.num_sessions,
        num_owned_requests=msg.num_owned_requests,
        current_epoch=msg.current_epoch,
        duration_s=msg.duration_seconds,
    )


class AsyncKVClient:
    """A scheduler's connection to one kvservice server (grpc.aio).

    Values come back as the dataclasses of ``kvservice.client.types``; ``allocate_slots``
    answers None when there is no room, as vLLM does; refusals raise the typed errors
    of ``kvservice.client.errors``. Use it as an async context manager, or ``close()``.

    ``retries`` (opt-in, 0 by default): mutating calls carry an operation id and are
    sent again, up to that many times with backoff, after UNAVAILABLE or
    DEADLINE_EXCEEDED; the server applies each at most once. ``open_session`` binds
    the client to a server session whose lease it renews in the background.

    Security: ``token`` is sent as ``authorization: Bearer <token>`` with every call
    and stream. ``tls=True`` or any PEM turns on TLS: ``root_certificates`` to check
    the server (the system roots when None), ``certificate_chain`` and
    ``private_key`` for a server that requires client certificates (mutual TLS). A
    token without TLS raises ``InsecureTokenError`` unless ``allow_insecure_token``
    is True (a loopback server in plaintext).
    """

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
        self._channel = (
            grpc.aio.insecure_channel(target)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials)
        )
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self._base_metadata = call_metadata(client_id) + bearer_metadata(token)
        self._metadata = self._base_metadata
        self._timeout = timeout
        self._retries = retries
        self._step_ids = itertools.count(1)
        # The session this client's calls run under (``open_session``), if any.
        self._lease: AsyncLease | None = None

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; an open session is left to run out (its requests are
        freed then), as if the client had crashed: close the lease first to end it."""
        if self._lease is not None:
            await self._lease.stop_renewing()
        await self._channel.close()

    async def _call(self, op: _wire.Op[T]) -> T:
        return op.parse(await self._invoke(op.rpc, op.message))

    async def _invoke(self, rpc: str, message: Any) -> Any:
        """One unary call, retried (with one operation id) when ``retries`` allows."""
        method = getattr(self._stub, rpc)
        metadata = with_operation_id(self._metadata, rpc, self._retries)
        attempt = 0
        while True:
            try:
                return await method(message, metadata=metadata, timeout=self._timeout)
            except grpc.aio.AioRpcError as err:
                if attempt >= self._retries or err.code() not in RETRYABLE_CODES:
                    raise error_from_rpc(err) from None
            await asyncio.sleep(retry_delay(attempt))
            attempt += 1

    async def add_request(
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
        return await self._call(op)

    async def append_tokens(
        self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
    ) -> RequestState:
        """Append sampled tokens (for a client_hashed request, with the hashes of the
        blocks they complete)."""
        return await self._call(_wire.append_tokens(request_id, token_ids, block_hashes))

    async def get_computed_blocks(
        self, request_id: str, max_cache_hit_length: int | None = None
    ) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request (pass it as ``hit``), at
        most ``max_cache_hit_length`` tokens."""
        return await self._call(_wire.get_computed_blocks(request_id, max_cache_hit_length))

    async def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> Allocation | None:
        """vLLM's allocate_slots; None when there is no room (nothing changed)."""
        return await self._call(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

    async def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions | None = None,
    ) -> AdmitResult:
        """Admit waiting requests in order within ``token_budget``, as vLLM's
        scheduler does: for each, the prefix lookup, its share of the budget, then
        allocate_slots with the hit; stops at the first that does not fit (see
        ``AdmitResult.stop_reason``). One call for what takes two per request."""
        return await self._call(_wire.admit(request_ids, token_budget, options))

    async def free(self, request_id: str, mode: FreeMode = FreeMode.FINISH) -> FreeResult:
        """Release the request's blocks; PREEMPT keeps it for re-prefill."""
        return await self._call(_wire.free(request_id, mode))

    async def probe(
        self,
        request_id: str,
        num_new_tokens: int | None = None,
        options: ProbeOptions | None = None,
    ) -> ProbeResult:
        """What a lookup plus allocate_slots would do now; changes nothing."""
        return await self._call(_wire.probe(request_id, num_new_tokens, options))

    async def get_request(self, request_id: str) -> RequestState:
        return await self._call(_wire.get_request(request_id))

    async def get_block_ids(self, request_id: str) -> BlockIds:
        return await self._call(_wire.get_block_ids(request_id))

    async def get_usage(self, pool_wide: bool = False) -> Usage:
        """The caller's tenant's usage (see ``Usage``); ``pool_wide``: every tenant's
        together (admin tenants only, else ``PermissionDeniedError``)."""
        return await self._call(_wire.get_usage(pool_wide))

    async def reset_prefix_cache(self, *, fresh_pool: bool = False) -> bool:
        """Forget every cached prefix; False while blocks are in use. ``fresh_pool``
        also puts the free blocks back in a new pool's order."""
        return await self._call(_wire.reset_prefix_cache(fresh_pool))

    async def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM's ``new_step_starts``), before the step's
        lookups, allocations and ``admit``: a Mamba state cached from now on is
        refused as a prefix hit until the next one."""
        return await self._call(_wire.new_step_starts())

    async def free_retained_blocks(self, block_ids: Sequence[int]) -> int:
        """Release copy holds this client's session kept (a step sent with
        ``keep_copy_holds``), in the order given; the pool's free blocks after."""
        return await self._call(_wire.free_retained_blocks(block_ids))

    async def cache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """vLLM's ``cache_blocks``: hash into the prefix cache the request's blocks
        its first ``num_computed_tokens`` tokens fill (monotonic, idempotent)."""
        return await self._call(_wire.cache_blocks(request_id, num_computed_tokens))

    async def pin_prefix(
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
        return await self._call(op)

    async def unpin_prefix(self, pin_id: str) -> None:
        """Drop one of the caller's tenant's pins; ``RequestNotFoundError`` (NOT_FOUND)
        when it has no such pin."""
        return await self._call(_wire.unpin_prefix(pin_id))

    async def list_pins(self, *, all_tenants: bool = False) -> PinList:
        """The caller's tenant's pins and the pool's pinned budget (``all_tenants``:
        every tenant's, for an admin tenant or a server without tenants)."""
        return await self._call(_wire.list_pins(all_tenants))

    async def get_cache_config(self) -> CacheConfig:
        return await self._call(_wire.get_cache_config())

    async def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Run the builder's operations as one ``Step`` call."""
        request = builder.to_pb(next(self._step_ids), stop_on_error)
        return StepResults(await self._invoke("Step", request))

    async def audit(self) -> AuditReport:
        """Have the server check every invariant of its pool (O(pool size))."""
        return audit_report(await self._invoke("Audit", pb.AuditRequest()))

    async def open_session(
        self, ttl_s: float = 0.0, *, epoch: int = 0, client_name: str = "", replica: bool = False
    ) -> AsyncLease:
        """Open a server session (``ttl_s`` 0: the server's default lease) and send its
        id with every later call of this client; the lease is renewed in the
        background until the handle is closed. Requests added from now on are owned
        by the session: the server frees them if the lease runs out. A session opened
        before stops being renewed. Raises
        ``FailedPreconditionError`` when a newer ``epoch`` has taken over. ``replica``:
        the caller keeps a replica of the pool, so the server's retention changes
        reach it with its Step answers (``StepResults.retention_changes``), at its
        step boundaries."""
        response = await self._invoke(
            "OpenSession",
            pb.OpenSessionRequest(
                ttl_seconds=ttl_s, client_name=client_name, epoch=epoch, replica=replica
            ),
        )
        if self._lease is not None:
            # One session per client: the previous one is no longer renewed.
            await self._lease.stop_renewing()
        self._metadata = (*self._base_metadata, (SESSION_KEY, response.session_id))
        self._lease = AsyncLease(self, response.session_id, epoch, response.ttl_seconds)
        self._lease.start()
        return self._lease

    async def _keep_alive(self, session_id: str) -> None:
        await self._invoke("KeepAlive", pb.KeepAliveRequest(session_id=session_id))

    async def _close_session(self, session_id: str, free_requests: bool) -> int:
        if self._lease is not None and self._lease.session_id == session_id:
            self._metadata, self._lease = self._base_metadata, None
        response = await self._invoke(
            "CloseSession",
            pb.CloseSessionRequest(session_id=session_id, free_requests=free_requests),
        )
        freed: int = response.num_requests_freed
        return freed

    async def subscribe_events(
        self, from_sequence: int = 0, log_id: str = ""
    ) -> AsyncGenerator[EventStreamItem, None]:
        """The server's KV events (it must run with ``--kv-events``): a
        ``CacheSnapshot`` first unless the server still holds every event after
        ``from_sequence`` (of ``log_id``), then each event in order, until the
        iterator is closed. No call timeout applies. Raises
        ``FailedPreconditionError`` when events are off, ``SubscriberDroppedError``
        when this subscriber fell too far behind (resubscribe from the last
        sequence seen)."""
        call = self._stub.SubscribeEvents(
            pb.SubscribeEventsRequest(from_sequence=from_sequence, log_id=log_id),
            metadata=self._metadata,
        )
        decoder = StreamDecoder()
        try:
            async for message in call:
                item = decoder.feed(message)
                if item is not None:
                    yield item
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, subscription=True) from None
        finally:
            # Closing the iterator early must end the server's stream too.
            call.cancel()

    def session(self) -> AsyncSession:
        """One ``StepStream`` (``async with client.session() as s``); not a server
        session, which ``open_session`` opens."""
        return AsyncSession(self._stub.StepStream(metadata=self._metadata))

    async def socket_session(self, path: str) -> AsyncSession:
        """One StepStream on the server's step socket at ``path`` (``kvservice serve
        --step-socket``, same node): ``session()`` without gRPC, under this client's
        token and session."""
        return AsyncSession(await SocketCall.connect(path, self._metadata))


class AsyncPendingStep(StepAnswer):
    """A step sent on an ``AsyncSession`` and not yet read: ``await result()`` waits
    for its ``StepResults``, or raises the call's typed error, the same every time."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[AsyncPendingStep], Awaitable[None]]) -> None:
        super().__init__()
        # Reads answers until this step's is in.
        self._wait = wait

    async def result(self) -> StepResults:
        if not self._done:
            await self._wait(self)
        return self._answer()


class AsyncSession:
    """One long-lived ``StepStream``: steps run in the order sent, each answered in
    order. (A server session, the lease that owns requests, is an ``AsyncLease``.)

    ``send`` writes a step and returns at once (the server starts on it while the
    caller goes on); ``step`` is ``send`` and then its ``result()``. Closing
    half-closes the stream after reading every answer still unread; cancelling drops
    it (each step sent was applied entirely or not at all; reconcile with
    ``get_request``).
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        # Steps written whose answers are not read yet, oldest first.
        self._unread: collections.deque[AsyncPendingStep] = collections.deque()
        self._reported: KVServiceError | None = None
        self._step_ids = itertools.count(1)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.close()
        else:
            self.cancel()

    async def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Send one step and wait for its results."""
        return await (await self.send(builder, stop_on_error=stop_on_error)).result()

    async def send(self, builder: StepBuilder, *, stop_on_error: bool = False) -> AsyncPendingStep:
        """Write one step without waiting for its answer; ``await result()`` does."""
        message = builder.to_stream_pb(next(self._step_ids), stop_on_error)
        async with self._write_lock:
            pending = AsyncPendingStep(self._read_through)
            # Queued in the order written: answers come back in that order.
            self._unread.append(pending)
            try:
                await self._call.write(message)
            except grpc.aio.AioRpcError as err:
                self._unread.remove(pending)
                self._reported = error_from_rpc(err)
                raise self._reported from None
        return pending

    async def _read_through(self, pending: AsyncPendingStep) -> None:
        """Read answers, oldest first, until ``pending``'s."""
        async with self._read_lock:
            while not pending.done():
                oldest = self._unread.popleft()
                try:
                    response = await self._call.read()
                except grpc.aio.AioRpcError as err:
                    self._reported = error_from_rpc(err)
                    oldest.resolve_error(self._reported)
                    continue
                except BaseException:
                    # Cancelled mid-read: the answer is still the oldest step's.
                    self._unread.appendleft(oldest)
                    raise
                if response is grpc.aio.EOF:
                    self._reported = await self._ended_error()
                    oldest.resolve_error(self._reported)
                    continue
                oldest.resolve(StepResults(response.step))

    async def _ended_error(self) -> KVServiceError:
        code = await self._call.code()
        return error_for(code, await self._call.details() or "the stream ended")

    async def close(self) -> None:
        """Read the answers still unread (into their steps), half-close and wait for
        the server to end the stream; raises its error unless a step already did."""
        if self._unread:
            await self._read_through(self._unread[-1])
        if self._reported is None:
            await self._call.done_writing()
        if await self._call.code() != grpc.StatusCode.OK and self._reported is None:
            raise await self._ended_error()

    def cancel(self) -> None:
        """Drop the stream at once."""
        self._call.cancel()


class AsyncLease:
    """An open server session (``AsyncKVClient.open_session``): a task renews its
    lease every third of its TTL. ``lost`` holds the error that ended the lease on
    the server's side (expired, or a newer epoch took over), None while it holds.
    ``close()`` ends it (``async with`` closes it too)."""

    def __init__(self, client: AsyncKVClient, session_id: str, epoch: int, ttl_s: float) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self.ttl_s = ttl_s
        self.lost: KVServiceError | None = None
        self._client = client
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"AsyncLease(session_id={self.session_id!r}, epoch={self.epoch}, ttl_s={self.ttl_s})"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew())

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / RENEWALS_PER_TTL)
            try:
                await self._client._keep_alive(self.session_id)
            except KVServiceError as err:
                if err.code in LEASE_LOST_CODES:
                    self.lost = err
                    return
                # Unreachable for now: keep trying while the lease may still hold.

    async def stop_renewing(self) -> None:
        """Stop the background renewal (the lease then runs out on the server)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, free_requests: bool = True) -> int:
        """Stop renewing and end the session; with ``free_requests`` the server frees
        (FINISH) every request it owns. Returns how many it freed."""
        await self.stop_renewing()
        return await self._client._close_session(self.session_id, free_requests)
