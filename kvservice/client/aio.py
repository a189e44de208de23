"""The asyncio client: one channel, typed methods, batched steps and stream sessions."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvservice.client import _wire
from kvservice.client.errors import KVServiceError, error_for, error_from_rpc
from kvservice.client.events import EventStreamItem, StreamDecoder
from kvservice.client.step import StepBuilder, StepResults
from kvservice.client.types import (
    AllocateOptions,
    Allocation,
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    FreeResult,
    MultiModalFeature,
    ProbeOptions,
    ProbeResult,
    RequestState,
    Usage,
)
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc

T = TypeVar("T")
DEFAULT_TARGET = "127.0.0.1:50051"


def call_metadata(client_id: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata sent with every call: ``x-client-id`` names the scheduler."""
    return (("x-client-id", client_id),) if client_id else ()


class AsyncKVClient:
    """A scheduler's connection to one kvservice server (grpc.aio).

    Values come back as the dataclasses of ``kvservice.client.types``; ``allocate_slots``
    answers None when there is no room, as vLLM does; refusals raise the typed errors
    of ``kvservice.client.errors``. Use it as an async context manager, or ``close()``.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        client_id: str | None = None,
        timeout: float | None = 30.0,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self._metadata = call_metadata(client_id)
        self._timeout = timeout
        self._step_ids = itertools.count(1)

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
        await self._channel.close()

    async def _call(self, op: _wire.Op[T]) -> T:
        method = getattr(self._stub, op.rpc)
        try:
            response = await method(op.message, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return op.parse(response)

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
    ) -> RequestState:
        """Register a WAITING request with its prompt."""
        op = _wire.add_request(
            request_id,
            prompt_token_ids,
            cache_salt,
            lora_name,
            mm_features,
            skip_reading_prefix_cache,
        )
        return await self._call(op)

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestState:
        """Append sampled tokens."""
        return await self._call(_wire.append_tokens(request_id, token_ids))

    async def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request (pass it as ``hit``)."""
        return await self._call(_wire.get_computed_blocks(request_id))

    async def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> Allocation | None:
        """vLLM's allocate_slots; None when there is no room (nothing changed)."""
        return await self._call(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

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

    async def get_usage(self) -> Usage:
        return await self._call(_wire.get_usage())

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while blocks are in use."""
        return await self._call(_wire.reset_prefix_cache())

    async def get_cache_config(self) -> CacheConfig:
        return await self._call(_wire.get_cache_config())

    async def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Run the builder's operations as one ``Step`` call."""
        request = builder.to_pb(next(self._step_ids), stop_on_error)
        try:
            response = await self._stub.Step(
                request, metadata=self._metadata, timeout=self._timeout
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return StepResults(response)

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
            raise error_from_rpc(err) from None
        finally:
            # Closing the iterator early must end the server's stream too.
            call.cancel()

    def session(self) -> AsyncSession:
        """A ``StepStream`` session (``async with client.session() as s``)."""
        return AsyncSession(self._stub.StepStream(metadata=self._metadata))


class AsyncSession:
    """One long-lived ``StepStream``: each ``step`` is answered in order.

    Steps are sent one at a time (a lock pairs each message with its answer). Closing
    half-closes the stream; cancelling drops it (each step sent was applied entirely
    or not at all; reconcile with ``get_request``).
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._lock = asyncio.Lock()
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
        message = builder.to_stream_pb(next(self._step_ids), stop_on_error)
        async with self._lock:
            try:
                await self._call.write(message)
                response = await self._call.read()
            except grpc.aio.AioRpcError as err:
                self._reported = error_from_rpc(err)
                raise self._reported from None
            if response is grpc.aio.EOF:
                self._reported = await self._ended_error()
                raise self._reported
        return StepResults(response.step)

    async def _ended_error(self) -> KVServiceError:
        code = await self._call.code()
        return error_for(code, await self._call.details() or "the stream ended")

    async def close(self) -> None:
        """Half-close and wait for the server to end the stream; raises its error
        unless ``step`` already did."""
        if self._reported is None:
            await self._call.done_writing()
        if await self._call.code() != grpc.StatusCode.OK and self._reported is None:
            raise await self._ended_error()

    def cancel(self) -> None:
        """Drop the stream at once."""
        self._call.cancel()
