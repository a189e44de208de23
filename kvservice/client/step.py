"""Batched steps without protobuf: a builder that hands out typed handles, and the
results read back through them.

    step = StepBuilder()
    hit = step.get_computed_blocks("a")
    usage = step.get_usage()
    results = await client.step(step)
    results[hit]          # ComputedBlocks, or raises the operation's typed error
    results.error(usage)  # None, or the KVServiceError it failed with

Operations run in order on the server; a failed one changed nothing and, unless
``stop_on_error``, the later ones still ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvservice.client import _wire
from kvservice.client.errors import KVServiceError, error_for_number
from kvservice.client.types import (
    AdmitResult,
    AllocateOptions,
    Allocation,
    BlockIds,
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

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OpHandle(Generic[T]):
    """Where one operation's result will be in the step's results."""

    index: int
    parse: Callable[[Any], T]


class StepBuilder:
    """Collects one step's operations, in order; each method returns a handle.

    ``omit_request_state`` asks the server to leave the request state out of the
    step's allocation answers (``Allocation.request`` then raises
    ``RequestStateOmittedError``): less to encode, send and decode per allocation, for
    a scheduler that counts its requests' tokens itself.
    """

    def __init__(self, *, omit_request_state: bool = False) -> None:
        # Built inside the stream's wrapper message, so a session sends it without a
        # copy; ``Step`` sends the inner message.
        self._wrapper = pb.StepStreamRequest()
        self._request = self._wrapper.step
        if omit_request_state:
            self._request.omit_request_state = True

    def __len__(self) -> int:
        return len(self._request.ops)

    def _add(self, op: _wire.Op[T]) -> OpHandle[T]:
        index = len(self._request.ops)
        # One call that copies the message into the new operation's oneof field.
        self._request.ops.add(**{op.field: op.message})
        return OpHandle(index, op.parse)

    def to_pb(self, step_id: int = 0, stop_on_error: bool = False) -> pb.StepRequest:
        """The ``Step`` message (for the clients; it shares the builder's operations)."""
        self._request.step_id = step_id
        self._request.stop_on_error = stop_on_error
        return self._request

    def to_stream_pb(self, step_id: int = 0, stop_on_error: bool = False) -> pb.StepStreamRequest:
        """The ``StepStream`` message around ``to_pb``."""
        self.to_pb(step_id, stop_on_error)
        return self._wrapper

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
    ) -> OpHandle[RequestState]:
        return self._add(
            _wire.add_request(
                request_id,
                prompt_token_ids,
                cache_salt,
                lora_name,
                mm_features,
                skip_reading_prefix_cache,
            )
        )

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> OpHandle[RequestState]:
        return self._add(_wire.append_tokens(request_id, token_ids))

    def get_computed_blocks(self, request_id: str) -> OpHandle[ComputedBlocks]:
        return self._add(_wire.get_computed_blocks(request_id))

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> OpHandle[Allocation | None]:
        return self._add(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        *,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> OpHandle[AdmitResult]:
        return self._add(
            _wire.admit(
                request_ids,
                token_budget,
                enable_chunked_prefill,
                num_lookahead_tokens,
                full_sequence_must_fit,
            )
        )

    def free(self, request_id: str, mode: FreeMode = FreeMode.FINISH) -> OpHandle[FreeResult]:
        return self._add(_wire.free(request_id, mode))

    def probe(
        self,
        request_id: str,
        num_new_tokens: int | None = None,
        options: ProbeOptions | None = None,
    ) -> OpHandle[ProbeResult]:
        return self._add(_wire.probe(request_id, num_new_tokens, options))

    def get_request(self, request_id: str) -> OpHandle[RequestState]:
        return self._add(_wire.get_request(request_id))

    def get_block_ids(self, request_id: str) -> OpHandle[BlockIds]:
        return self._add(_wire.get_block_ids(request_id))

    def get_usage(self) -> OpHandle[Usage]:
        return self._add(_wire.get_usage())


class StepResults:
    """The answers of one step, read through the builder's handles."""

    def __init__(self, response: pb.StepResponse) -> None:
        self.step_id = response.step_id
        self._results = response.results

    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, handle: OpHandle[T]) -> T:
        """The operation's value; raises its typed error if it failed."""
        result = self._results[handle.index]
        kind = result.WhichOneof("result")
        if kind == "error" or kind is None:
            raise error_for_number(result.error.code, result.error.message)
        return handle.parse(getattr(result, kind))

    def error(self, handle: OpHandle[Any]) -> KVServiceError | None:
        """The operation's error, or None if it succeeded."""
        result = self._results[handle.index]
        if result.WhichOneof("result") != "error":
            return None
        return error_for_number(result.error.code, result.error.message)

    @property
    def errors(self) -> dict[int, KVServiceError]:
        """Every failed operation's error, by its index in the step."""
        return {
            i: error_for_number(r.error.code, r.error.message)
            for i, r in enumerate(self._results)
            if r.WhichOneof("result") == "error"
        }

    @property
    def ok(self) -> bool:
        """Whether every operation succeeded."""
        return not any(r.WhichOneof("result") == "error" for r in self._results)
