"""``KVCacheService``: each RPC hands its message to an operation and returns the answer.

The per-request operations live in ``operations`` (shared with ``Step``), batched steps
in ``step``. Errors are raised, never handled here: ``RpcInterceptor`` turns them into
statuses. The methods are ``async`` because grpc.aio wants coroutines, but none awaits
while it touches the allocator: each runs to completion on the loop that owns it, which
is what makes the allocator safe without locks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvservice.server import converters, operations
from kvservice.server.allocator import Allocator
from kvservice.server.events import EventLog, SubscriberDroppedError
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.step import StepRunner

# grpc is untyped: the servicer context is Any.
Context = Any


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    """The gRPC face of one ``Allocator``."""

    def __init__(
        self,
        allocator: Allocator,
        model_name: str,
        max_step_ops: int,
        runtime_device: str = "",
        events: EventLog | None = None,
    ) -> None:
        self._allocator = allocator
        self._model_name = model_name
        # Where the co-located runtime's KV tensors live; "" without a runtime.
        self._runtime_device = runtime_device
        self._steps = StepRunner(allocator, max_step_ops)
        # The KV event log; None when the server runs without --kv-events.
        self._events = events

    async def AddRequest(  # noqa: N802
        self, request: pb.AddRequestRequest, context: Context
    ) -> pb.AddRequestResponse:
        """Register a WAITING request. ALREADY_EXISTS for a known id; INVALID_ARGUMENT
        for an empty id or prompt, a negative token id or a multimodal item outside
        the prompt; OUT_OF_RANGE past max_model_len."""
        response = pb.AddRequestResponse()
        operations.add_request(self._allocator, request, response)
        return response

    async def AppendTokens(  # noqa: N802
        self, request: pb.AppendTokensRequest, context: Context
    ) -> pb.AppendTokensResponse:
        """Append sampled tokens. NOT_FOUND, INVALID_ARGUMENT (none or negative),
        OUT_OF_RANGE (past max_model_len)."""
        response = pb.AppendTokensResponse()
        operations.append_tokens(self._allocator, request, response)
        return response

    async def GetComputedBlocks(  # noqa: N802
        self, request: pb.GetComputedBlocksRequest, context: Context
    ) -> pb.GetComputedBlocksResponse:
        """The cached prefix, remembered for AllocateSlots. NOT_FOUND;
        FAILED_PRECONDITION for a running request."""
        response = pb.GetComputedBlocksResponse()
        operations.get_computed_blocks(self._allocator, request, response)
        return response

    async def AllocateSlots(  # noqa: N802
        self, request: pb.AllocateSlotsRequest, context: Context
    ) -> pb.AllocateSlotsResponse:
        """vLLM's allocate_slots; NO_SPACE is an OK answer. With a co-located runtime the
        fresh blocks are zeroed before this returns. NOT_FOUND; INVALID_ARGUMENT
        (negative counts, zero tokens); OUT_OF_RANGE (past max_model_len);
        FAILED_PRECONDITION (hit not matching the lookup, counts going backwards);
        ABORTED (the hit was evicted since the lookup)."""
        response = pb.AllocateSlotsResponse()
        operations.allocate_slots(self._allocator, request, response)
        return response

    async def FreeRequest(  # noqa: N802
        self, request: pb.FreeRequestRequest, context: Context
    ) -> pb.FreeRequestResponse:
        """Release the request's blocks (PREEMPT or FINISH). NOT_FOUND;
        INVALID_ARGUMENT without a mode; FAILED_PRECONDITION to preempt a request
        that is not running."""
        response = pb.FreeRequestResponse()
        operations.free_request(self._allocator, request, response)
        return response

    async def GetRequest(  # noqa: N802
        self, request: pb.GetRequestRequest, context: Context
    ) -> pb.GetRequestResponse:
        """A request's state. NOT_FOUND."""
        response = pb.GetRequestResponse()
        operations.get_request(self._allocator, request, response)
        return response

    async def GetBlockIds(  # noqa: N802
        self, request: pb.GetBlockIdsRequest, context: Context
    ) -> pb.GetBlockIdsResponse:
        """The request's block table per group. NOT_FOUND."""
        response = pb.GetBlockIdsResponse()
        operations.get_block_ids(self._allocator, request, response)
        return response

    async def ResetPrefixCache(  # noqa: N802
        self, request: pb.ResetPrefixCacheRequest, context: Context
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every cached prefix; reset is false while blocks are in use."""
        return pb.ResetPrefixCacheResponse(reset=self._allocator.reset_prefix_cache())

    async def GetUsage(  # noqa: N802
        self, request: pb.GetUsageRequest, context: Context
    ) -> pb.GetUsageResponse:
        """Pool usage and prefix cache totals."""
        response = pb.GetUsageResponse()
        operations.get_usage(self._allocator, request, response)
        return response

    async def GetCacheConfig(  # noqa: N802
        self, request: pb.GetCacheConfigRequest, context: Context
    ) -> pb.GetCacheConfigResponse:
        """The pool layout and hashing parameters."""
        return converters.cache_config_to_pb(
            self._allocator.manager, self._model_name, self._runtime_device
        )

    async def Probe(  # noqa: N802
        self, request: pb.ProbeRequest, context: Context
    ) -> pb.ProbeResponse:
        """What a lookup plus AllocateSlots would do, changing nothing. NOT_FOUND;
        INVALID_ARGUMENT and OUT_OF_RANGE as AllocateSlots."""
        response = pb.ProbeResponse()
        operations.probe(self._allocator, request, response)
        return response

    async def Step(  # noqa: N802
        self, request: pb.StepRequest, context: Context
    ) -> pb.StepResponse:
        """One step's operations in order, one result each (see ``step``); with a
        co-located runtime the step's fresh blocks are zeroed once, after the last
        operation and before this returns. INVALID_ARGUMENT, nothing run, over the
        operations-per-step limit."""
        response = pb.StepResponse()
        self._steps.run(request, response)
        return response

    async def StepStream(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.StepStreamRequest], context: Context
    ) -> AsyncIterator[pb.StepStreamResponse]:
        """A scheduler session: each inbound step answered by one message, in order.
        Ends with INVALID_ARGUMENT on a step over the limit."""
        async for message in request_iterator:
            response = pb.StepStreamResponse()
            self._steps.run(message.step, response.step)
            yield response

    async def SubscribeEvents(  # noqa: N802
        self, request: pb.SubscribeEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        """A snapshot or the missed events, then every new KV event (see ``events``).
        FAILED_PRECONDITION without --kv-events; RESOURCE_EXHAUSTED when the
        subscriber falls too far behind."""
        if self._events is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV events are off on this server; start it with --kv-events "
                "(KVSERVICE_KV_EVENTS=1, or kv_events = true in the config file)",
            )
            return
        # Anything a change queued is already published (the allocator hands events
        # on after every change); this only guards against a path that forgot to.
        self._allocator.publish_events()
        try:
            async for message in self._events.subscribe(request.from_sequence, request.log_id):
                yield message
        except SubscriberDroppedError as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
