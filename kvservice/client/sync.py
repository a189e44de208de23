"""The blocking client: the same methods as ``AsyncKVClient``, on a sync channel."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Generator, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvservice.client import _wire
from kvservice.client.aio import DEFAULT_TARGET, call_metadata
from kvservice.client.errors import ServiceUnavailableError, error_from_rpc
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


class KVClient:
    """A blocking connection to one kvservice server; see ``AsyncKVClient``."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        client_id: str | None = None,
        timeout: float | None = 30.0,
    ) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self._metadata = call_metadata(client_id)
        self._timeout = timeout
        self._step_ids = itertools.count(1)

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
        self._channel.close()

    def _call(self, op: _wire.Op[T]) -> T:
        method = getattr(self._stub, op.rpc)
        try:
            response = method(op.message, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return op.parse(response)

    def add_request(
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
        return self._call(op)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestState:
        """Append sampled tokens."""
        return self._call(_wire.append_tokens(request_id, token_ids))

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request (pass it as ``hit``)."""
        return self._call(_wire.get_computed_blocks(request_id))

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> Allocation | None:
        """vLLM's allocate_slots; None when there is no room (nothing changed)."""
        return self._call(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

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

    def get_usage(self) -> Usage:
        return self._call(_wire.get_usage())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while blocks are in use."""
        return self._call(_wire.reset_prefix_cache())

    def get_cache_config(self) -> CacheConfig:
        return self._call(_wire.get_cache_config())

    def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Run the builder's operations as one ``Step`` call."""
        request = builder.to_pb(next(self._step_ids), stop_on_error)
        try:
            response = self._stub.Step(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return StepResults(response)

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
            raise error_from_rpc(err) from None
        finally:
            call.cancel()

    def session(self) -> Session:
        """A ``StepStream`` session (``with client.session() as s``)."""
        return Session(self._stub, self._metadata)


_CLOSE = None  # put on the outbound queue to half-close the stream


class Session:
    """One long-lived ``StepStream`` on the blocking API; see ``AsyncSession``.

    Not thread safe: one thread drives a session.
    """

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._outbound: queue.SimpleQueue[pb.StepStreamRequest | None] = queue.SimpleQueue()
        self._responses = stub.StepStream(self._messages(), metadata=metadata)
        self._step_ids = itertools.count(1)

    def _messages(self) -> Iterator[pb.StepStreamRequest]:
        while (message := self._outbound.get()) is not _CLOSE:
            yield message

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.cancel()

    def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Send one step and wait for its results."""
        self._outbound.put(builder.to_stream_pb(next(self._step_ids), stop_on_error))
        try:
            response = next(self._responses)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        except StopIteration:
            raise ServiceUnavailableError(grpc.StatusCode.UNAVAILABLE, "the stream ended") from None
        return StepResults(response.step)

    def close(self) -> None:
        """Half-close and wait for the server to end the stream."""
        self._outbound.put(_CLOSE)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    def cancel(self) -> None:
        """Drop the stream at once."""
        self._outbound.put(_CLOSE)
        self._responses.cancel()
