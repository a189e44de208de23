"""``KVCacheService``: each RPC hands its message to an operation and returns the answer.

The per-request operations live in ``operations`` (shared with ``Step``), batched steps
in ``step``. Errors are raised, never handled here: ``RpcLayer`` turns them into
statuses. Each reads the caller the RPC boundary established (``caller``) once and
names it on every call into the request table. None awaits while it touches the table:
each runs to completion on the loop that owns it, which is what makes the table safe
without locks. The exceptions are the calls that may carry thousands of entries (a
Step, an Admit) and a session's end (CloseSession), which pause every slice of work
holding the table's turn (``turns``): a call that touches the table then waits for it
(and otherwise runs at once).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.server import converters, operations
from kvservice.server.audit import Auditor
from kvservice.server.caller import Caller
from kvservice.server.config import HashSeedSource
from kvservice.server.events import EventLog, SubscriberDroppedError
from kvservice.server.offload_tiers import OffloadTiers
from kvservice.server.sessions import SessionPolicy, SessionRegistry
from kvservice.server.step import StepRunner
from kvservice.server.turns import Slices, TableTurn

# grpc is untyped: the servicer context is Any.
Context = Any
Response = TypeVar("Response")


class KVCacheServicer:
    """The gRPC face of one ``RequestTable``: every KVCacheService RPC, each taking the
    ``Caller`` the RPC boundary established (``caller.CallerLayer`` passes it)."""

    def __init__(
        self,
        table: RequestTable,
        model_name: str,
        max_step_ops: int,
        runtime_device: str = "",
        events: EventLog | None = None,
        sessions: SessionRegistry | None = None,
        auditor: Auditor | None = None,
        turn: TableTurn | None = None,
        seed_source: HashSeedSource = HashSeedSource.RANDOM,
        offload_tiers: OffloadTiers | None = None,
    ) -> None:
        self._table = table
        # The table's turn, shared with everything else that touches it.
        self._turn = turn or TableTurn()
        # Client sessions and the audit (``sessions``, ``audit``); the server passes
        # its own, shared with the reaper and the self-check.
        self._sessions = sessions or SessionRegistry(table, SessionPolicy(), turn=self._turn)
        self._auditor = auditor or Auditor(table, self._sessions, turn=self._turn)
        self._model_name = model_name
        # Where the co-located runtime's KV tensors live; "" without a runtime.
        self._runtime_device = runtime_device
        self._steps = StepRunner(table, max_step_ops, self._turn, self._sessions.check_live)
        # The KV event log; None when the server runs without --kv-events.
        self._events = events
        # Where the hash chain's seed came from (GetCacheConfig reports it).
        self._seed_source = seed_source
        # The engines' CPU offload tier indexes (OffloadStep), dropped with their session.
        if offload_tiers is None:
            offload_tiers = OffloadTiers(max_step_ops)
            self._sessions.end_listeners.append(offload_tiers.session_ended)
        self._offload_tiers = offload_tiers

    async def _run(
        self, operation: operations.Operation, request: Any, response: Response, caller: Caller
    ) -> Response:
        """``operation`` for this call's caller, answering into ``response``, in the
        table's turn. A call that waited for the turn re-checks its session first: it
        may have ended meanwhile (FAILED_PRECONDITION, nothing done)."""
        waited = self._turn.taken
        async with self._turn:
            if waited and caller.session_id is not None:
                self._sessions.check_live(caller.session_id, caller.tenant)
            operation(self._table, request, response, caller, True)
        return response

    async def AddRequest(  # noqa: N802
        self, request: pb.AddRequestRequest, context: Context, caller: Caller
    ) -> pb.AddRequestResponse:
        """Register a WAITING request. ALREADY_EXISTS for a known id; INVALID_ARGUMENT
        for an empty id or prompt, a negative token id, a multimodal item outside
        the prompt, a malformed retention or cache_control_ttl; OUT_OF_RANGE past
        max_model_len; FAILED_PRECONDITION for retention on an LRU pool;
        RESOURCE_EXHAUSTED for a cache_control_ttl pin the pool refuses (nothing
        added)."""
        return await self._run(operations.add_request, request, pb.AddRequestResponse(), caller)

    async def AppendTokens(  # noqa: N802
        self, request: pb.AppendTokensRequest, context: Context, caller: Caller
    ) -> pb.AppendTokensResponse:
        """Append sampled tokens. NOT_FOUND, INVALID_ARGUMENT (none or negative),
        OUT_OF_RANGE (past max_model_len)."""
        return await self._run(operations.append_tokens, request, pb.AppendTokensResponse(), caller)

    async def GetComputedBlocks(  # noqa: N802
        self, request: pb.GetComputedBlocksRequest, context: Context, caller: Caller
    ) -> pb.GetComputedBlocksResponse:
        """The cached prefix, remembered for AllocateSlots. NOT_FOUND;
        FAILED_PRECONDITION for a running request."""
        return await self._run(
            operations.get_computed_blocks, request, pb.GetComputedBlocksResponse(), caller
        )

    async def AllocateSlots(  # noqa: N802
        self, request: pb.AllocateSlotsRequest, context: Context, caller: Caller
    ) -> pb.AllocateSlotsResponse:
        """vLLM's allocate_slots; NO_SPACE is an OK answer. With a co-located runtime the
        fresh blocks are zeroed before this returns. NOT_FOUND; INVALID_ARGUMENT
        (negative counts, zero tokens); OUT_OF_RANGE (past max_model_len);
        FAILED_PRECONDITION (hit not matching the lookup, counts going backwards);
        ABORTED (the hit was evicted since the lookup)."""
        return await self._run(
            operations.allocate_slots, request, pb.AllocateSlotsResponse(), caller
        )

    async def Admit(  # noqa: N802
        self, request: pb.AdmitRequest, context: Context, caller: Caller
    ) -> pb.AdmitResponse:
        """Admit waiting requests in order within a token budget: a lookup and an
        AllocateSlots each, stopping where vLLM's scheduler would. NOT_FOUND;
        FAILED_PRECONDITION (a running request); INVALID_ARGUMENT (no ids, a repeated
        id, a negative budget or lookahead); all checked before anything runs. A
        long one pauses between admissions holding the table's turn, like a Step, and
        runs entirely or not at all."""
        response = pb.AdmitResponse()
        waited = self._turn.taken
        async with self._turn:
            if waited and caller.session_id is not None:
                self._sessions.check_live(caller.session_id, caller.tenant)
            slices = Slices()
            await operations.admit(self._table, request, response, caller, False, True, slices)
        slices.finish()
        return response

    async def NewStepStarts(  # noqa: N802
        self, request: pb.NewStepStartsRequest, context: Context, caller: Caller
    ) -> pb.NewStepStartsResponse:
        """A scheduler step begins (vLLM's new_step_starts): a Mamba state cached from
        now on is refused as a prefix hit until the next one."""
        return await self._run(
            operations.new_step_starts, request, pb.NewStepStartsResponse(), caller
        )

    async def FreeRetainedBlocks(  # noqa: N802
        self, request: pb.FreeRetainedBlocksRequest, context: Context, caller: Caller
    ) -> pb.FreeRetainedBlocksResponse:
        """Release copy holds the caller's session kept (StepRequest.keep_copy_holds),
        in the order given. FAILED_PRECONDITION, nothing released, for a block the
        session does not hold that many times (or a call without a session)."""
        return await self._run(
            operations.free_retained_blocks, request, pb.FreeRetainedBlocksResponse(), caller
        )

    async def CacheBlocks(  # noqa: N802
        self, request: pb.CacheBlocksRequest, context: Context, caller: Caller
    ) -> pb.CacheBlocksResponse:
        """vLLM's cache_blocks: hash into the prefix cache the blocks the request's first
        num_computed_tokens tokens fill. NOT_FOUND; OUT_OF_RANGE past its known tokens
        or its allocated slots."""
        return await self._run(operations.cache_blocks, request, pb.CacheBlocksResponse(), caller)

    async def FreeRequest(  # noqa: N802
        self, request: pb.FreeRequestRequest, context: Context, caller: Caller
    ) -> pb.FreeRequestResponse:
        """Release the request's blocks (PREEMPT or FINISH). NOT_FOUND;
        INVALID_ARGUMENT without a mode; FAILED_PRECONDITION to preempt a request
        that is not running."""
        return await self._run(operations.free_request, request, pb.FreeRequestResponse(), caller)

    async def GetRequest(  # noqa: N802
        self, request: pb.GetRequestRequest, context: Context, caller: Caller
    ) -> pb.GetRequestResponse:
        """A request's state. NOT_FOUND."""
        return await self._run(operations.get_request, request, pb.GetRequestResponse(), caller)

    async def GetBlockIds(  # noqa: N802
        self, request: pb.GetBlockIdsRequest, context: Context, caller: Caller
    ) -> pb.GetBlockIdsResponse:
        """The request's block table per group. NOT_FOUND."""
        return await self._run(operations.get_block_ids, request, pb.GetBlockIdsResponse(), caller)

    async def ResetPrefixCache(  # noqa: N802
        self, request: pb.ResetPrefixCacheRequest, context: Context, caller: Caller
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every cached prefix (``fresh_pool``: and restore a new pool's block
        order); reset is false while blocks are in use."""
        reset = await self._turn.run(lambda: self._table.reset_prefix_cache(request.fresh_pool))
        return pb.ResetPrefixCacheResponse(reset=reset)

    async def GetUsage(  # noqa: N802
        self, request: pb.GetUsageRequest, context: Context, caller: Caller
    ) -> pb.GetUsageResponse:
        """Pool usage and prefix cache totals."""
        return await self._run(operations.get_usage, request, pb.GetUsageResponse(), caller)

    async def GetCacheConfig(  # noqa: N802
        self, request: pb.GetCacheConfigRequest, context: Context, caller: Caller
    ) -> pb.GetCacheConfigResponse:
        """The pool layout and hashing parameters, and the caller's scheduler epoch."""
        table = self._table
        response = converters.cache_config_to_pb(
            table.manager,
            self._model_name,
            self._runtime_device,
            table.vocab_size,
            self._seed_source,
            table.client_hashes.trusts(caller.tenant),
        )
        response.scheduler_epoch = self._sessions.current_epoch(caller.tenant)
        return response

    async def Probe(  # noqa: N802
        self, request: pb.ProbeRequest, context: Context, caller: Caller
    ) -> pb.ProbeResponse:
        """What a lookup plus AllocateSlots would do, changing nothing. NOT_FOUND;
        INVALID_ARGUMENT and OUT_OF_RANGE as AllocateSlots."""
        return await self._run(operations.probe, request, pb.ProbeResponse(), caller)

    async def Step(  # noqa: N802
        self, request: pb.StepRequest, context: Context, caller: Caller
    ) -> pb.StepResponse:
        """One step's operations in order, one result each (see ``step``); with a
        co-located runtime the step's fresh blocks are zeroed once, after the last
        operation and before this returns. INVALID_ARGUMENT, nothing run, over the
        operations-per-step limit; under a session that ends while the step pauses, the
        later operations answer FAILED_PRECONDITION without running."""
        response = pb.StepResponse()
        await self._steps.run(request, response, caller)
        return response

    async def StepStream(  # noqa: N802
        self,
        request_iterator: AsyncIterator[pb.StepStreamRequest],
        context: Context,
        caller: Caller,
    ) -> AsyncIterator[pb.StepStreamResponse]:
        """A scheduler session: each inbound step answered by one message, in order.
        Ends with INVALID_ARGUMENT on a step over the limit. Opened under a client
        session (x-kvservice-session), the stream holds its lease and each message
        renews it; a stream the client cancels or drops ends the session at once,
        freeing its requests (``SessionLayer``); FAILED_PRECONDITION once the
        session's epoch is superseded."""
        async for message in request_iterator:
            response = pb.StepStreamResponse()
            await self._steps.run(message.step, response.step, caller)
            yield response

    async def OffloadStep(  # noqa: N802
        self, request: pb.OffloadStepRequest, context: Context, caller: Caller
    ) -> pb.OffloadStepResponse:
        """One scheduler step of the caller's engine's CPU offload tier index: its
        replica's operations, run in order and each answer checked (``offload_tiers``).
        FAILED_PRECONDITION without a session, for another config, once the index
        stopped, and at the first operation refused or answered otherwise (the index
        stops); INVALID_ARGUMENT for a malformed message (nothing run)."""
        return self._offload_tiers.step(caller.session_id, request)

    async def SubscribeEvents(  # noqa: N802
        self, request: pb.SubscribeEventsRequest, context: Context, caller: Caller
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
        # Anything a change queued is already published (the table hands events on
        # after every change); this only guards against a path that forgot to.
        self._table.publish_events()
        try:
            async for message in self._events.subscribe(request.from_sequence, request.log_id):
                yield message
        except SubscriberDroppedError as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))

    async def OpenSession(  # noqa: N802
        self, request: pb.OpenSessionRequest, context: Context, caller: Caller
    ) -> pb.OpenSessionResponse:
        """Open a session of the caller's tenant (see ``sessions``). INVALID_ARGUMENT
        for a ttl_seconds outside the server's bounds, a negative epoch or an
        over-long client_name; FAILED_PRECONDITION for an epoch older than the
        current one, or for a second replica session of a pool with retention."""
        tenant = caller.tenant
        async with self._turn:
            if request.replica:
                self._table.check_replica_free()
            lease = self._sessions.open(
                tenant, request.ttl_seconds, request.client_name, request.epoch
            )
            if request.replica:
                self._table.start_replica(lease.session.session_id)
        return pb.OpenSessionResponse(
            session_id=lease.session.session_id,
            ttl_seconds=lease.session.ttl_s,
            lease_expires_at=lease.expires_at_unix,
            current_epoch=self._sessions.current_epoch(tenant),
        )

    async def KeepAlive(  # noqa: N802
        self, request: pb.KeepAliveRequest, context: Context, caller: Caller
    ) -> pb.KeepAliveResponse:
        """Renew a session's lease. NOT_FOUND for a session never opened by the
        caller's tenant; FAILED_PRECONDITION for one that ended (expired, broken or
        closed: open a new one) or whose epoch was superseded."""
        lease = self._sessions.keep_alive(request.session_id, caller.tenant)
        return pb.KeepAliveResponse(lease_expires_at=lease.expires_at_unix)

    async def CloseSession(  # noqa: N802
        self, request: pb.CloseSessionRequest, context: Context, caller: Caller
    ) -> pb.CloseSessionResponse:
        """End a session, freeing (FINISH) its requests with free_requests, else
        leaving them unowned. NOT_FOUND for a session never opened by the caller's
        tenant; FAILED_PRECONDITION for one that already ended."""
        tenant = caller.tenant
        async with self._turn:
            end = self._sessions.begin_close(request.session_id, tenant, request.free_requests)
            # Thousands of requests are freed a slice at a time, the turn held between.
            slices = Slices()
            while not end.resume(slices):
                await slices.pause()
        slices.finish()
        return pb.CloseSessionResponse(num_requests_freed=end.num_freed)

    async def PinPrefix(  # noqa: N802
        self, request: pb.PinPrefixRequest, context: Context, caller: Caller
    ) -> pb.PinPrefixResponse:
        """Pin a token prefix for the caller's tenant (README, Retention); pinning it
        again refreshes the pin. RESOURCE_EXHAUSTED (pinning off, past the pinned
        budget); INVALID_ARGUMENT (shorter than a block, bad ids or TTL); OUT_OF_RANGE
        (past max_model_len). A refusal pins nothing."""
        return await self._run(operations.pin_prefix, request, pb.PinPrefixResponse(), caller)

    async def UnpinPrefix(  # noqa: N802
        self, request: pb.UnpinPrefixRequest, context: Context, caller: Caller
    ) -> pb.UnpinPrefixResponse:
        """Drop one of the caller's tenant's pins. NOT_FOUND for a pin the tenant does
        not have; INVALID_ARGUMENT for an empty pin_id."""
        return await self._run(operations.unpin_prefix, request, pb.UnpinPrefixResponse(), caller)

    async def ListPins(  # noqa: N802
        self, request: pb.ListPinsRequest, context: Context, caller: Caller
    ) -> pb.ListPinsResponse:
        """The caller's tenant's pins (all_tenants: every tenant's, for admins) and the
        pool's pinned budget. PERMISSION_DENIED for all_tenants from a non-admin."""
        return await self._run(operations.list_pins, request, pb.ListPinsResponse(), caller)

    async def Audit(  # noqa: N802
        self, request: pb.AuditRequest, context: Context, caller: Caller
    ) -> pb.AuditResponse:
        """Check every invariant of the pool and report (see ``audit``); a violation
        is reported with ok = false, not as an error status. O(pool size); a large
        pool is checked in a forked snapshot while calls go on being served."""
        report = await self._auditor.run()
        return pb.AuditResponse(
            ok=report.ok,
            violations=report.violations,
            num_free_blocks=report.num_free_blocks,
            num_held_blocks=report.num_held_blocks,
            num_cached_blocks=report.num_cached_blocks,
            num_requests=report.num_requests,
            num_sessions=report.num_sessions,
            num_owned_requests=report.num_owned_requests,
            current_epoch=self._sessions.current_epoch(caller.tenant),
            duration_seconds=report.duration_s,
        )
