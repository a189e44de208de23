"""Remote backends that batch a scheduling step: ``StepBackend`` sends ``Step`` RPCs,
``StreamBackend`` messages on one ``StepStream`` session.

The scheduler reads two answers in the middle of a step: whether a running request's
allocation fit (no room means preempting) and which waiting requests ``admit`` let
in. Everything else (``add_request``, ``append_tokens``, ``free``) is deferred to the
next send. An allocation is deferred too when the backend can prove it fits: it
tracks each request's computed tokens and blocks, and a lower bound of the pool's free
blocks (exact after every send, then lowered by each deferred allocation, never raised
by a deferred free), so a deferred allocation cannot answer "no room" and every
decision is the one the unary backend would make. An allocation it cannot prove, or an
``admit``, sends at once (a sync point) with everything deferred before it. At the
step's end (``end_step``) a send happens only if a deferred allocation still waits for
its block ids; the appends and frees that follow the forward pass wait for the next
step's message. ``flush`` sends what is left (the end of a run).

Sending ahead (``StreamBackend``): when the first provable allocation of a step finds
enough operations queued (the last step's appends and frees, this step's new requests,
whose prompts the server hashes), they leave at once, without waiting, and the server
runs them while the scheduler plans its running requests. The next send goes without
waiting for their answer either (the stream runs messages in order), then reads both;
an error in the operations sent ahead raises there, after that send's operations have
run too (each message runs on its own; none of these operations fails for a scheduler
that tracks its requests right). Nothing sent ahead takes a block (no allocation is
ever in it), so the free lower bound needs no answer from it. Such a step costs two
messages, the first overlapped with the scheduler's own work. ``Step`` RPCs in flight
together are not ordered, so ``StepBackend`` never sends ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvservice.client import (
    AdmitOptions,
    Allocation,
    FreeMode,
    KVClient,
    OpHandle,
    PendingStep,
    Session,
    StepBuilder,
    StepResults,
)
from kvservice.scheduler.backend import (
    AdmittedIds,
    AllocatedIds,
    BlockIds,
    PendingBlockIds,
    PrefixHit,
    admitted_from_result,
    allocate_options,
    as_computed_blocks,
    as_prefix_hit,
)

# Sends one step (stop_on_error on) and answers its results.
Send = Callable[[StepBuilder], StepResults]
# Sends one step (stop_on_error on) without waiting, on a transport that keeps order.
Start = Callable[[StepBuilder], PendingStep]

# Fewest queued operations worth a message of their own ahead of the step's: fewer
# give the server little to overlap, next to what one more message costs on each side
# (about a gRPC round trip of CPU). A judgement, not a tuned optimum: the benchmark's
# decode steps queue hundreds.
SEND_AHEAD_MIN_OPS = 32


class PredictionError(RuntimeError):
    """A deferred allocation was answered otherwise than proven: a bug in the block
    accounting, raised rather than letting the decisions drift from the server."""


@dataclass(slots=True)
class _RequestBlocks:
    """What the server holds for one request, as this backend counts it."""

    num_computed_tokens: int
    num_blocks: list[int]  # per KV cache group
    # Admitted: the admission watermark no longer applies to its allocations.
    running: bool = False


# Not frozen: one is built per deferred allocation (most of a decode step), and a
# frozen dataclass's __init__ costs several times a plain one's.
@dataclass(slots=True)
class _DeferredAllocation:
    handle: OpHandle[Allocation | None]
    # None when the allocation was proven to take no block: its answer is already known.
    pending: PendingBlockIds | None
    num_new_blocks: tuple[int, ...]  # per group, as proven


_NO_HIT = PrefixHit((), 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BatchingBackend:
    """A ``Backend`` over a kvservice server that defers what it can and sends the
    rest of a step in one message (see the module docstring); ``send`` carries it."""

    def __init__(
        self,
        client: KVClient,
        send: Send,
        start: Start | None = None,
        send_ahead_min_ops: int | None = SEND_AHEAD_MIN_OPS,
    ) -> None:
        config = client.get_cache_config()
        self._block_sizes = tuple(group.block_size for group in config.groups)
        # A proven allocation that takes no block: its counts, and the answer it gets.
        self._no_new_blocks = (0,) * len(self._block_sizes)
        self._no_block_ids: BlockIds = ((),) * len(self._block_sizes)
        # Only full attention needs a plain function of the token count; other kinds
        # (sliding windows release blocks as they go) always ask the server.
        self._provable = all(group.kind == "full_attention" for group in config.groups)
        self._max_model_len = config.max_model_len
        self._send = send
        # Sends ahead only where messages keep their order (a stream, not Step RPCs),
        # and only when asked to (a minimum of queued operations).
        self._start = start
        self._send_ahead_min_ops = send_ahead_min_ops
        self._builder = self._new_builder()
        self._deferred: list[_DeferredAllocation] = []
        # Operations sent ahead whose answer is not read yet (see the module docstring).
        self._ahead: PendingStep | None = None
        self._requests: dict[str, _RequestBlocks] = {}
        self._free_lower_bound = client.get_usage().num_free_blocks
        self.num_sends = 0  # messages sent (Step RPCs or stream messages)
        self.num_sent_ahead = 0  # of which sent ahead (nobody waited for them)

    # -- the Backend protocol -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._builder.add_request(request_id, prompt_token_ids)
        self._requests[request_id] = self._empty()

    def new_step_starts(self) -> None:
        """Deferred like an append: it leaves with the step's first message, after the
        previous step's appends and frees."""
        self._builder.new_step_starts()

    def get_computed_blocks(self, request_id: str) -> PrefixHit:
        handle = self._builder.get_computed_blocks(request_id)
        return as_prefix_hit(self._send_now()[handle])

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> AllocatedIds | None:
        options = allocate_options(num_lookahead_tokens, full_sequence_must_fit)
        state = self._requests.get(request_id)
        if state is not None and state.running and hit is None and not full_sequence_must_fit:
            proven = self._proven_new_blocks(state, num_new_tokens + num_lookahead_tokens)
            if proven is not None:
                if not self._deferred:
                    self._send_ahead()
                handle = self._builder.allocate_slots(request_id, num_new_tokens, None, options)
                return self._defer(handle, state, num_new_tokens, proven)
        computed = as_computed_blocks(hit)
        handle = self._builder.allocate_slots(request_id, num_new_tokens, computed, options)
        allocation = self._send_now()[handle]
        if allocation is None:
            return None
        if state is not None:
            hit = hit or _NO_HIT
            self._advance(state, hit.num_computed_tokens, hit.block_ids, num_new_tokens, allocation)
        return allocation.new_block_ids

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions,
    ) -> list[AdmittedIds]:
        """The step's admissions in the message that carries everything deferred so
        far (the running requests' allocations included): one round trip."""
        handle = self._builder.admit(request_ids, token_budget, options)
        # The usage read _send_now appends runs after the admissions: the free lower
        # bound it sets already counts their blocks.
        result = self._send_now()[handle]
        for item in result.admitted:
            state = self._requests.get(item.request_id)
            if state is not None:
                hit = item.hit
                self._advance(
                    state,
                    hit.num_computed_tokens,
                    hit.block_ids,
                    item.num_new_tokens,
                    item.allocation,
                )
        return admitted_from_result(result)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._builder.append_tokens(request_id, token_ids)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self._builder.free(request_id, FreeMode.PREEMPT if preempt else FreeMode.FINISH)
        # A preempted request re-prefills from nothing; a finished one is forgotten.
        if preempt:
            self._requests[request_id] = self._empty()
        else:
            self._requests.pop(request_id, None)

    def num_free_blocks(self) -> int:
        self._send_now()
        return self._free_lower_bound

    @property
    def free_blocks_at_last_send(self) -> int:
        """The pool's free blocks as the last message left them (after ``flush``:
        as the step left them), without a round trip."""
        if self._deferred:
            raise RuntimeError("allocations are deferred: flush before reading free blocks")
        return self._free_lower_bound

    def end_step(self) -> None:
        """Send only if a deferred allocation's block ids are still pending (a step
        without admissions); otherwise the step's appends and frees wait for the next
        message, so a step costs one message either way."""
        if self._deferred:
            self._send_now()

    def flush(self) -> None:
        """Send whatever is deferred and read what was sent ahead (nothing when there
        is neither)."""
        if len(self._builder) or self._ahead is not None:
            self._send_now()

    # -- block accounting ---------------------------------------------------------------

    def _empty(self) -> _RequestBlocks:
        return _RequestBlocks(0, [0] * len(self._block_sizes))

    def _proven_new_blocks(
        self, state: _RequestBlocks, num_slot_tokens: int
    ) -> tuple[int, ...] | None:
        """The blocks per group an allocation without a hit takes (as the manager
        counts them), when they certainly fit; None when only the server can tell."""
        if not self._provable:
            return None
        end = min(state.num_computed_tokens + num_slot_tokens, self._max_model_len)
        if len(self._block_sizes) == 1:
            # The common single-group pool, on every decode allocation of a step: the
            # same count without building a tuple from a generator, a fifth of the
            # cost (about 1 us less per running request and step).
            size = self._block_sizes[0]
            held = state.num_blocks[0] * size
            if end <= held:
                return self._no_new_blocks
            need = _cdiv(end - held, size)
            return (need,) if need <= self._free_lower_bound else None
        needed = tuple(
            max(_cdiv(end, size) - held, 0)
            for size, held in zip(self._block_sizes, state.num_blocks, strict=True)
        )
        return needed if sum(needed) <= self._free_lower_bound else None

    def _defer(
        self,
        handle: OpHandle[Allocation | None],
        state: _RequestBlocks,
        num_new_tokens: int,
        new_blocks: tuple[int, ...],
    ) -> AllocatedIds:
        state.num_computed_tokens += num_new_tokens
        if new_blocks == self._no_new_blocks:
            # Most decode allocations: no block to wait for, only the answer to check.
            self._deferred.append(_DeferredAllocation(handle, None, new_blocks))
            return self._no_block_ids
        pending = PendingBlockIds()
        self._deferred.append(_DeferredAllocation(handle, pending, new_blocks))
        self._free_lower_bound -= sum(new_blocks)
        for group, count in enumerate(new_blocks):
            state.num_blocks[group] += count
        return pending

    @staticmethod
    def _advance(
        state: _RequestBlocks,
        num_hit_tokens: int,
        hit_block_ids: BlockIds,
        num_new_tokens: int,
        allocation: Allocation,
    ) -> None:
        """Count an allocation the server answered: the attached hit, then the new
        blocks (an admission's or an unproven allocation's)."""
        state.num_computed_tokens += num_hit_tokens + num_new_tokens
        state.running = True
        for group, ids in enumerate(allocation.new_block_ids):
            state.num_blocks[group] += len(ids) + (
                len(hit_block_ids[group]) if hit_block_ids else 0
            )

    # -- sending ------------------------------------------------------------------------

    @staticmethod
    def _new_builder() -> StepBuilder:
        # The backend counts each request's tokens and blocks itself: the server need
        # not answer the request state with every allocation.
        return StepBuilder(omit_request_state=True)

    def _send_ahead(self) -> None:
        """Send the queued operations without waiting, when there are enough of them
        and nothing else is in flight (see the module docstring)."""
        start, min_ops = self._start, self._send_ahead_min_ops
        if (
            start is not None
            and min_ops is not None
            and self._ahead is None
            and len(self._builder) >= min_ops
        ):
            builder, self._builder = self._builder, self._new_builder()
            self._ahead = start(builder)
            self.num_sends += 1
            self.num_sent_ahead += 1

    def _read_ahead(self) -> None:
        """Wait for the operations sent ahead; raise the first one's error."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            _raise_first(ahead.result())

    def _send_now(self) -> StepResults:
        """Send every queued operation and a usage read; raise the first operation
        error (stop_on_error: nothing after it ran); resolve deferred allocations."""
        usage = self._builder.get_usage()
        builder, self._builder = self._builder, self._new_builder()
        deferred, self._deferred = self._deferred, []
        if self._ahead is None or self._start is None:
            results = self._send(builder)
        else:
            # Sent before the ahead answer is read: the stream runs it after them.
            pending = self._start(builder)
            self._read_ahead()
            results = pending.result()
        self.num_sends += 1
        _raise_first(results)
        for item in deferred:
            self._resolve(item, results[item.handle])
        self._free_lower_bound = results[usage].num_free_blocks
        return results

    @staticmethod
    def _resolve(item: _DeferredAllocation, allocation: Allocation | None) -> None:
        counts = None if allocation is None else tuple(map(len, allocation.new_block_ids))
        if allocation is None or counts != item.num_new_blocks:
            raise PredictionError(
                f"a deferred allocation (op {item.handle.index}) took {counts} blocks, "
                f"proven {item.num_new_blocks}"
            )
        if item.pending is not None:
            item.pending.set(allocation.new_block_ids)


def _raise_first(results: StepResults) -> None:
    errors = results.errors
    if errors:
        raise errors[min(errors)]


class StepBackend(BatchingBackend):
    """Batched steps over unary ``Step`` RPCs."""

    def __init__(self, client: KVClient) -> None:
        super().__init__(client, lambda builder: client.step(builder, stop_on_error=True))


class StreamBackend(BatchingBackend):
    """Batched steps over one ``StepStream`` session; ``close`` (or ``with``) ends it.
    Sends ahead (see the module docstring) once ``send_ahead_min_ops`` operations are
    queued; None never does."""

    def __init__(
        self, client: KVClient, *, send_ahead_min_ops: int | None = SEND_AHEAD_MIN_OPS
    ) -> None:
        self._stream: Session = client.session()
        stream = self._stream
        super().__init__(
            client,
            lambda builder: stream.step(builder, stop_on_error=True),
            lambda builder: stream.send(builder, stop_on_error=True),
            send_ahead_min_ops,
        )

    def close(self) -> None:
        """Send what is deferred, then end the stream."""
        self.flush()
        self._stream.close()

    def __enter__(self) -> StreamBackend:
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
            self._stream.cancel()
