"""``KVCacheService``: each RPC converts its message, calls the allocator, converts back.

Errors are raised, never handled here: ``RpcInterceptor`` turns them into statuses.
The methods are ``async`` because grpc.aio wants coroutines, but none awaits: each
runs to completion on the loop that owns the allocator, which is what makes the
allocator safe without locks.
"""

from __future__ import annotations

from typing import Any

from kvservice.server import converters
from kvservice.server.allocator import Allocator
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc

# grpc is untyped: the servicer context is Any.
Context = Any


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    """The gRPC face of one ``Allocator``."""

    def __init__(self, allocator: Allocator, model_name: str) -> None:
        self._allocator = allocator
        self._model_name = model_name

    async def AddRequest(  # noqa: N802
        self, request: pb.AddRequestRequest, context: Context
    ) -> pb.AddRequestResponse:
        """Register a WAITING request. ALREADY_EXISTS for a known id; INVALID_ARGUMENT
        for an empty id or prompt, a negative token id or a multimodal item outside
        the prompt; OUT_OF_RANGE past max_model_len."""
        added = self._allocator.add_request(converters.new_request_from_pb(request))
        return pb.AddRequestResponse(request=converters.request_state_to_pb(added))

    async def AppendTokens(  # noqa: N802
        self, request: pb.AppendTokensRequest, context: Context
    ) -> pb.AppendTokensResponse:
        """Append sampled tokens. NOT_FOUND, INVALID_ARGUMENT (none or negative),
        OUT_OF_RANGE (past max_model_len)."""
        updated = self._allocator.append_tokens(request.request_id, list(request.token_ids))
        return pb.AppendTokensResponse(request=converters.request_state_to_pb(updated))

    async def GetComputedBlocks(  # noqa: N802
        self, request: pb.GetComputedBlocksRequest, context: Context
    ) -> pb.GetComputedBlocksResponse:
        """The cached prefix, remembered for AllocateSlots. NOT_FOUND;
        FAILED_PRECONDITION for a running request."""
        hit = self._allocator.get_computed_blocks(request.request_id)
        return converters.computed_blocks_to_pb(hit)

    async def AllocateSlots(  # noqa: N802
        self, request: pb.AllocateSlotsRequest, context: Context
    ) -> pb.AllocateSlotsResponse:
        """vLLM's allocate_slots; NO_SPACE is an OK answer. NOT_FOUND; INVALID_ARGUMENT
        (negative counts, zero tokens); OUT_OF_RANGE (past max_model_len);
        FAILED_PRECONDITION (hit not matching the lookup, counts going backwards);
        ABORTED (the hit was evicted since the lookup)."""
        args = converters.allocate_args_from_pb(request)
        allocation = self._allocator.allocate_slots(request.request_id, args)
        return converters.allocation_to_pb(allocation)

    async def FreeRequest(  # noqa: N802
        self, request: pb.FreeRequestRequest, context: Context
    ) -> pb.FreeRequestResponse:
        """Release the request's blocks (PREEMPT or FINISH). NOT_FOUND;
        INVALID_ARGUMENT without a mode; FAILED_PRECONDITION to preempt a request
        that is not running."""
        mode = converters.free_mode_from_pb(request.mode)
        freed = self._allocator.free(request.request_id, mode)
        return pb.FreeRequestResponse(
            request=converters.request_state_to_pb(freed),
            num_free_blocks=self._allocator.usage().num_free_blocks,
        )

    async def GetRequest(  # noqa: N802
        self, request: pb.GetRequestRequest, context: Context
    ) -> pb.GetRequestResponse:
        """A request's state. NOT_FOUND."""
        found = self._allocator.get_request(request.request_id)
        return pb.GetRequestResponse(request=converters.request_state_to_pb(found))

    async def GetBlockIds(  # noqa: N802
        self, request: pb.GetBlockIdsRequest, context: Context
    ) -> pb.GetBlockIdsResponse:
        """The request's block table per group. NOT_FOUND."""
        block_ids = self._allocator.get_block_ids(request.request_id)
        return pb.GetBlockIdsResponse(block_ids=converters.block_ids_to_pb(block_ids))

    async def ResetPrefixCache(  # noqa: N802
        self, request: pb.ResetPrefixCacheRequest, context: Context
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every cached prefix; reset is false while blocks are in use."""
        return pb.ResetPrefixCacheResponse(reset=self._allocator.reset_prefix_cache())

    async def GetUsage(  # noqa: N802
        self, request: pb.GetUsageRequest, context: Context
    ) -> pb.GetUsageResponse:
        """Pool usage and prefix cache totals."""
        return converters.usage_to_pb(self._allocator.usage())

    async def GetCacheConfig(  # noqa: N802
        self, request: pb.GetCacheConfigRequest, context: Context
    ) -> pb.GetCacheConfigResponse:
        """The pool layout and hashing parameters."""
        return converters.cache_config_to_pb(self._allocator.manager, self._model_name)
