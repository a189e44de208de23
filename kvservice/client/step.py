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

The builder coalesces the commonest operations of a decode step: a run of consecutive
one-token ``append_tokens`` travels as one ``AppendTokensBatch``, a run of consecutive
plain ``allocate_slots`` (no hit, no options) as one ``AllocateSlotsBatch``. The server
runs each entry exactly as the single operation, so every handle still reads what it
would have read otherwise (value, ``None`` for no room, its own error, ``NotRunError``
after a failure under ``stop_on_error``); only the encoding changes.
``StepBuilder(coalesce=False)`` sends every operation on its own.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Generic, NamedTuple, Self, TypeVar

from kvservice.client import _wire
from kvservice.client.errors import KVServiceError, error_for_number
from kvservice.client.types import (
    AdmitOptions,
    AdmitResult,
    AllocateOptions,
    Allocation,
    BlockIds,
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
from kvservice.protocol.gen import kv_cache_service_pb2 as pb

T = TypeVar("T")


class OpHandle(NamedTuple, Generic[T]):
    """Where one operation's result will be in the step's results: ``index`` is its
    place among the step's operations (the key of ``StepResults.errors``), ``wire`` the
    place of the message operation that carries it, ``row`` its entry in that
    operation when it is a columnar one (-1 otherwise)."""

    # Speed: a named tuple, not a frozen dataclass (one is built per operation);
    # `python -m benchmarks.bench_decode_layers --requests 512 --steps 100 --layers client`:
    # client layer +14% us/request without (4.26 -> 4.88, medians of 4 runs; 2026-12-03).

    # Shadows tuple.index on purpose: the name handles have always read it by.
    index: int  # type: ignore[assignment]
    parse: Callable[[Any], T]
    wire: int
    row: int = -1


class RunHandle(NamedTuple, Generic[T]):
    """Where the entries of one ``*_batch`` call are in the step's results
    (``StepResults.rows``): ``index`` is the first entry's place among the step's
    operations, ``wire`` the columnar operation that carries them, ``row`` the first
    entry's row in it, ``num_entries`` how many there are."""

    index: int  # type: ignore[assignment]
    wire: int
    row: int
    num_entries: int


_PLAIN_OPTIONS = AllocateOptions()


def _same(value: Any) -> Any:
    # A batch entry is decoded with its whole batch (``_wire.BATCH_ROWS``).
    return value


class StepBuilder:
    """Collects one step's operations, in order; each method returns a handle.

    ``omit_request_state`` asks the server to leave the request state out of the
    step's allocation and append answers (``Allocation.request``, or a field of an
    ``append_tokens`` result, then raises ``RequestStateOmittedError``): less to
    encode, send and decode per operation, for a scheduler that counts its requests'
    tokens itself.

    ``coalesce`` (on by default) sends runs of one-token appends and of plain
    allocations as columnar operations (see the module docstring); off, every
    operation travels on its own.

    ``keep_copy_holds`` keeps the copy-on-write holds the step's allocations take
    (each copy's source and destination) until a later ``free_retained_blocks``
    releases them, as vLLM's scheduler holds ``take_kv_cache_block_copies``' retained
    blocks; the step must run under a session.
    """

    def __init__(
        self,
        *,
        omit_request_state: bool = False,
        coalesce: bool = True,
        keep_copy_holds: bool = False,
    ) -> None:
        # Built inside the stream's wrapper message, so a session sends it without a
        # copy; ``Step`` sends the inner message.
        self._wrapper = pb.StepStreamRequest()
        self._request = self._wrapper.step
        if omit_request_state:
            self._request.omit_request_state = True
        if keep_copy_holds:
            self._request.keep_copy_holds = True
        self._coalesce = coalesce
        self._num_ops = 0
        # The columnar operation the next eligible operation joins: its StepResult
        # field name, its message and its place; None after any other operation.
        self._open_kind: str | None = None
        self._open_values: Any = None  # its value column
        self._open_ids: Any = None  # its request_ids column
        self._open_wire = 0
        self._open_rows = 0
        # The fields of the open columnar operation that every entry shares (a
        # lookup_allocate_batch's options, an add_request_batch's client_hashed): an
        # entry with others opens a batch of its own.
        self._open_shared: object = _PLAIN_OPTIONS

    def __len__(self) -> int:
        """Operations added (a columnar message counts each of its entries)."""
        return self._num_ops

    def _add(self, op: _wire.Op[T]) -> OpHandle[T]:
        index = self._num_ops
        self._num_ops += 1
        self._open_kind = None
        wire = len(self._request.ops)
        # One call that copies the message into the new operation's oneof field.
        self._request.ops.add(**{op.field: op.message})
        return OpHandle(index, op.parse, wire)

    def _entry(self, kind: str, column: str, request_id: str, value: int) -> OpHandle[Any]:
        """Add an entry to the open columnar operation of ``kind`` (opening one when the
        last operation is not one), its ``column`` value first. A value or id the
        message refuses raises as the single operation's message would, leaving the
        builder as it was."""
        if self._open_kind != kind:
            self._open(kind, column)
        # Speed: the open operation's columns cached, not looked up per entry;
        # `python -m benchmarks.bench_decode_layers --requests 512 --steps 100 --layers client`:
        # client layer +29% us/request without (4.26 -> 5.50, medians of 4; 2026-12-03).
        row = self._open_rows
        try:
            self._open_values.append(value)
            self._open_ids.append(request_id)
        except Exception:
            del self._open_values[row:], self._open_ids[row:]
            self._close_if_empty()
            raise
        self._open_rows = row + 1
        index = self._num_ops
        self._num_ops = index + 1
        return OpHandle(index, _same, self._open_wire, row)

    def _entries(
        self, kind: str, column: str, request_ids: Sequence[str], values: Sequence[int]
    ) -> RunHandle[Any]:
        """``_entry`` for each (request id, value) pair, in one call per column."""
        count = len(request_ids)
        if len(values) != count:
            raise ValueError(f"{count} request ids but {len(values)} values")
        if not count:
            return RunHandle(self._num_ops, -1, 0, 0)
        if self._open_kind != kind:
            self._open(kind, column)
        row = self._open_rows
        try:
            self._open_values.extend(values)
            self._open_ids.extend(request_ids)
        except Exception:
            self._drop_rows(row)
            raise
        self._open_rows = row + count
        index = self._num_ops
        self._num_ops = index + count
        return RunHandle(index, self._open_wire, row, count)

    def _drop_rows(self, row: int) -> None:
        """Take the open columnar operation's entries from ``row`` on out of the
        builder (a call whose values the message refused), and the operation with them
        when it is left empty."""
        added = self._open_rows - row
        if added > 0:
            self._num_ops -= added
            self._open_rows = row
        del self._open_values[row:], self._open_ids[row:]
        self._close_if_empty()

    def _open(self, kind: str, column: str) -> None:
        """Open a columnar operation of ``kind``, with no entry yet."""
        opened = getattr(self._request.ops.add(), kind)
        self._open_kind = kind
        self._open_values = getattr(opened, column)
        self._open_ids = opened.request_ids
        self._open_wire = len(self._request.ops) - 1
        self._open_rows = 0

    def _close_if_empty(self) -> None:
        """Drop the open columnar operation if it has no entry (its first was refused)."""
        if not self._open_rows:
            del self._request.ops[-1]
            self._open_kind = None

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
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        prompt_embeds: bytes | bytearray | memoryview | None = None,
        prompt_embeds_row_bytes: int = 0,
        retention: Retention | None = None,
        cache_control_ttl: str | float | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> OpHandle[RequestState]:
        """``KVClient.add_request`` in the step."""
        return self._add(
            _wire.add_request(
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
        )

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
    ) -> OpHandle[Pin]:
        """``KVClient.pin_prefix`` in the step."""
        return self._add(
            _wire.pin_prefix(
                token_ids, ttl_s, refresh_on_hit, cache_salt, lora_name, lora_path, block_hashes
            )
        )

    def unpin_prefix(self, pin_id: str) -> OpHandle[None]:
        """``KVClient.unpin_prefix`` in the step."""
        return self._add(_wire.unpin_prefix(pin_id))

    def list_pins(self, *, all_tenants: bool = False) -> OpHandle[PinList]:
        """``KVClient.list_pins`` in the step."""
        return self._add(_wire.list_pins(all_tenants))

    def new_step_starts(self) -> OpHandle[None]:
        """A scheduler step begins, in order among the step's operations: after the
        previous step's frees, before this step's lookups, allocations and ``admit``."""
        return self._add(_wire.new_step_starts())

    def free_retained_blocks(self, block_ids: Sequence[int]) -> OpHandle[int]:
        """Release copy holds kept by an earlier step (``keep_copy_holds``), in the
        order given; answers the pool's free blocks after."""
        return self._add(_wire.free_retained_blocks(block_ids))

    def cache_blocks(self, request_id: str, num_computed_tokens: int) -> OpHandle[None]:
        """vLLM's ``cache_blocks`` for ``request_id`` (see ``KVClient.cache_blocks``)."""
        return self._add(_wire.cache_blocks(request_id, num_computed_tokens))

    def append_tokens(
        self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
    ) -> OpHandle[RequestState]:
        if self._coalesce and len(token_ids) == 1 and not block_hashes:
            return self._entry(_wire.APPEND_TOKENS_BATCH, "token_ids", request_id, token_ids[0])
        return self._add(_wire.append_tokens(request_id, token_ids, block_hashes))

    def append_tokens_batch(
        self,
        request_ids: Sequence[str],
        token_ids: Sequence[int],
        block_hashes: Sequence[Sequence[bytes]] | None = None,
    ) -> RunHandle[RequestState]:
        """One token for each request, in order: ``append_tokens(request_ids[i],
        [token_ids[i]], block_hashes[i])`` for every i (``block_hashes`` None: none
        carries a hash), as entries of one columnar operation (or of the open one),
        without a handle per entry."""
        if block_hashes is not None and len(block_hashes) != len(request_ids):
            raise ValueError(f"{len(request_ids)} request ids but {len(block_hashes)} block_hashes")
        run = self._entries(_wire.APPEND_TOKENS_BATCH, "token_ids", request_ids, token_ids)
        if run.num_entries and block_hashes is not None and any(block_hashes):
            batch = self._request.ops[run.wire].append_tokens_batch
            self._add_hashes(run, batch, block_hashes)
        return run

    def _add_hashes(
        self, run: RunHandle[Any], batch: Any, block_hashes: Sequence[Sequence[bytes]]
    ) -> None:
        """``run``'s block hashes into its batch's concatenated column, with a count per
        entry (0 for the batch's entries before it that had none to send); ``run``'s
        entries taken out of the builder again when the message refuses a hash."""
        num_hashes = len(batch.block_hashes)
        try:
            batch.block_hashes.extend([h for hashes in block_hashes for h in hashes])
        except Exception:
            del batch.block_hashes[num_hashes:]
            self._drop_rows(run.row)
            raise
        counts = batch.num_block_hashes
        counts.extend([0] * (run.row - len(counts)))
        counts.extend([len(hashes) for hashes in block_hashes])

    def allocate_slots_batch(
        self, request_ids: Sequence[str], num_new_tokens: Sequence[int]
    ) -> RunHandle[Allocation | None]:
        """``allocate_slots(request_ids[i], num_new_tokens[i])`` (no hit, no options)
        for every i, in order, as entries of one columnar operation (or of the open
        one), without a handle per entry."""
        return self._entries(
            _wire.ALLOCATE_SLOTS_BATCH, "num_new_tokens", request_ids, num_new_tokens
        )

    def lookup_allocate_batch(
        self,
        request_ids: Sequence[str],
        num_new_tokens: Sequence[int],
        options: AllocateOptions | None = None,
    ) -> RunHandle[tuple[ComputedBlocks, Allocation | None]]:
        """For every i, in order: ``get_computed_blocks(request_ids[i])``, then
        ``allocate_slots(request_ids[i], num_new_tokens[i], hit=<that answer>,
        options=options)``, how vLLM's scheduler schedules a waiting request, as
        entries of one columnar operation (or of the open one, when it has the same
        options). Each entry reads (the lookup's answer, the allocation or None for no
        room), or the error that refused its lookup or its allocation. ``options``
        may not set a connector's arguments or ``num_computed_tokens`` (ValueError):
        those allocations are single ones."""
        options = options or _PLAIN_OPTIONS
        if not _wire.batchable(options):
            raise ValueError(f"lookup_allocate_batch cannot carry {options}: allocate singly")
        kind = _wire.LOOKUP_ALLOCATE_BATCH
        opens = self._opens(kind, options)
        run = self._entries(kind, "num_new_tokens", request_ids, num_new_tokens)
        if opens and run.num_entries:
            batch = self._request.ops[run.wire].lookup_allocate_batch
            _wire.set_lookup_allocate_options(batch, options)
            self._open_shared = options
        return run

    def _opens(self, kind: str, shared: object) -> bool:
        """Whether the next entries of ``kind`` open a batch: none is open, or the open
        one's shared fields are not ``shared``."""
        if self._open_kind == kind and self._open_shared != shared:
            self._open_kind = None
        return self._open_kind != kind

    def free_batch(
        self,
        request_ids: Sequence[str],
        modes: Sequence[FreeMode],
        keep_blocks: Sequence[bool] = (),
    ) -> RunHandle[None]:
        """``free(request_ids[i], modes[i], keep_blocks[i])`` for every i (no
        ``keep_blocks``: none keeps its blocks), in order, as entries of one columnar
        operation (or of the open one). An entry reads None (nothing is answered about
        a freed request), or its error."""
        if keep_blocks and len(keep_blocks) != len(request_ids):
            raise ValueError(f"{len(request_ids)} request ids but {len(keep_blocks)} keep_blocks")
        run = self._entries(_wire.FREE_BATCH, "modes", request_ids, _wire.free_modes(modes))
        if run.num_entries:
            # The column is empty until an entry keeps its blocks, then one per entry.
            keep = self._request.ops[run.wire].free_batch.keep_blocks
            if keep or any(keep_blocks):
                keep.extend([False] * (run.row - len(keep)))
                keep.extend(keep_blocks or [False] * run.num_entries)
        return run

    def add_request_batch(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Sequence[int]],
        block_hashes: Sequence[Sequence[bytes]] | None = None,
    ) -> RunHandle[None]:
        """``add_request(request_ids[i], prompts[i], block_hashes=block_hashes[i])``
        for every i (``block_hashes`` None: the server hashes every prompt), in order,
        as entries of one columnar operation (or of the open one, when its entries
        are client_hashed alike). For plain requests: one with any other argument is a
        single ``add_request``. An entry reads None (a new request's state is its
        prompt), or its error. ValueError, adding nothing, for uneven columns or a
        token id that does not pack into 4 unsigned bytes."""
        count = len(request_ids)
        if len(prompts) != count or (block_hashes is not None and len(block_hashes) != count):
            raise ValueError(
                f"{count} request ids but {len(prompts)} prompts"
                + ("" if block_hashes is None else f" and {len(block_hashes)} block_hashes")
            )
        packed = _wire.pack_prompts(prompts)
        hashed = block_hashes is not None
        opens = self._opens(_wire.ADD_REQUEST_BATCH, hashed)
        counts = [len(prompt) for prompt in prompts]
        run = self._entries(_wire.ADD_REQUEST_BATCH, "num_prompt_tokens", request_ids, counts)
        if not run.num_entries:
            return run
        batch = self._request.ops[run.wire].add_request_batch
        if block_hashes is not None:
            self._add_hashes(run, batch, block_hashes)
            batch.client_hashed = True
        batch.packed_prompt_token_ids += packed
        if opens:
            self._open_shared = hashed
        return run

    def get_computed_blocks(
        self, request_id: str, max_cache_hit_length: int | None = None
    ) -> OpHandle[ComputedBlocks]:
        return self._add(_wire.get_computed_blocks(request_id, max_cache_hit_length))

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> OpHandle[Allocation | None]:
        if self._coalesce and options is None and (hit is None or not hit.num_computed_tokens):
            # What the single operation would send: a hit of no tokens is not sent.
            return self._entry(
                _wire.ALLOCATE_SLOTS_BATCH, "num_new_tokens", request_id, num_new_tokens
            )
        return self._add(_wire.allocate_slots(request_id, num_new_tokens, hit, options))

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions | None = None,
    ) -> OpHandle[AdmitResult]:
        return self._add(_wire.admit(request_ids, token_budget, options))

    def free(
        self, request_id: str, mode: FreeMode = FreeMode.FINISH, keep_blocks: bool = False
    ) -> OpHandle[FreeResult]:
        """Free ``request_id``; with ``keep_blocks`` (vLLM's ``pop_blocks_for_free``)
        its blocks stay held for this session until ``free_retained_blocks``."""
        return self._add(_wire.free(request_id, mode, keep_blocks))

    def evict_blocks(self, block_ids: Sequence[int]) -> OpHandle[None]:
        """vLLM's ``evict_blocks``: drop the cache entries of the caller's blocks whose
        KV failed to load (Step only)."""
        return self._add(_wire.evict_blocks(block_ids))

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int
    ) -> OpHandle[int]:
        """vLLM's ``remove_skipped_blocks`` (Step only); the pool's free blocks after."""
        return self._add(_wire.remove_skipped_blocks(request_id, processed_computed_tokens))

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

    def get_usage(self, pool_wide: bool = False) -> OpHandle[Usage]:
        """The caller's tenant's usage; ``pool_wide``: the pool's (admin tenants)."""
        return self._add(_wire.get_usage(pool_wide))


class StepResults:
    """The answers of one step, read through the builder's handles. A columnar
    operation's entries are decoded together, when the first of them is read."""

    def __init__(self, response: pb.StepResponse) -> None:
        self.step_id = response.step_id
        self._results = response.results
        # To a replica session: what the server decided for its retention (rarely any).
        self.retention_changes = (
            _wire.retention_changes(response.retention_events) if response.retention_events else ()
        )
        # wire index -> the decoded entries of a columnar operation.
        self._rows: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        """Operations answered (a columnar one counts each of its entries)."""
        return sum(n for n, _ in self._spans())

    def __getitem__(self, handle: OpHandle[T]) -> T:
        """The operation's value; raises its typed error if it failed."""
        if handle.row < 0:
            result = self._results[handle.wire]
            kind = result.WhichOneof("result")
            if kind == "error" or kind is None:
                raise error_for_number(result.error.code, result.error.message)
            return handle.parse(getattr(result, kind))
        value = self._row(handle)
        if value.__class__ is _wire.RowError:
            raise error_for_number(value.code, value.message)
        return handle.parse(value)

    def rows(self, handle: RunHandle[T]) -> list[T]:
        """The values of a ``*_batch`` call's entries, in order; raises the first failed
        entry's typed error."""
        if not handle.num_entries:
            return []
        rows = self._decoded(handle.wire)
        if rows.__class__ is _wire.RowError:
            raise error_for_number(rows.code, rows.message)
        values: list[Any] = rows[handle.row : handle.row + handle.num_entries]
        for value in values:
            if value.__class__ is _wire.RowError:
                raise error_for_number(value.code, value.message)
        return values

    def allocations_match(
        self, handle: RunHandle[Allocation | None], answers: Sequence[BlockIds | None]
    ) -> bool:
        """Whether ``allocate_slots_batch``'s entries all ran, without copy-on-write
        copies, and got exactly ``answers`` (new block ids per group; None: no room),
        checked on the columns without decoding an entry (``rows`` gives the detail)."""
        result = self._results[handle.wire]
        if result.WhichOneof("result") != _wire.ALLOCATE_SLOTS_BATCH:
            return False
        return _wire.allocation_run_matches(result.allocate_slots_batch, handle.row, answers)

    def lookups_allocations_match(
        self,
        handle: RunHandle[tuple[ComputedBlocks, Allocation | None]],
        hits: Sequence[ComputedBlocks],
        answers: Sequence[BlockIds | None],
    ) -> bool:
        """``allocations_match`` for ``lookup_allocate_batch``'s entries, whose lookups
        must also have answered ``hits``."""
        result = self._results[handle.wire]
        if result.WhichOneof("result") != _wire.LOOKUP_ALLOCATE_BATCH:
            return False
        return _wire.lookup_allocation_run_matches(
            result.lookup_allocate_batch, handle.row, hits, answers
        )

    def error(self, handle: OpHandle[Any]) -> KVServiceError | None:
        """The operation's error, or None if it succeeded."""
        if handle.row < 0:
            result = self._results[handle.wire]
            if result.WhichOneof("result") != "error":
                return None
            return error_for_number(result.error.code, result.error.message)
        value = self._row(handle)
        if value.__class__ is _wire.RowError:
            return error_for_number(value.code, value.message)
        return None

    def _row(self, handle: OpHandle[Any]) -> Any:
        rows = self._decoded(handle.wire)
        if rows.__class__ is _wire.RowError:
            return rows
        return rows[handle.row]

    def _decoded(self, wire: int) -> Any:
        """The decoded entries of the columnar operation at ``wire``, or the
        ``RowError`` every entry reads when the batch was refused as a whole."""
        rows = self._rows.get(wire)
        if rows is None:
            result = self._results[wire]
            kind = result.WhichOneof("result")
            if kind == "error" or kind is None:
                return _wire.RowError(result.error.code, result.error.message)
            rows = self._rows[wire] = _wire.BATCH_ROWS[kind](getattr(result, kind))
        return rows

    def _spans(self) -> Iterator[tuple[int, Any]]:
        """(operations answered, the StepResult) per message operation. A batch
        refused as a whole counts as one: StepBuilder never sends one that can be."""
        for result in self._results:
            kind = result.WhichOneof("result")
            if kind in _wire.BATCH_ROWS:
                yield getattr(result, kind).num_requests, result
            else:
                yield 1, result

    @property
    def errors(self) -> dict[int, KVServiceError]:
        """Every failed operation's error, by its index in the step (its handle's
        ``index``), in ascending order."""
        errors: dict[int, KVServiceError] = {}
        index = 0
        for count, result in self._spans():
            kind = result.WhichOneof("result")
            if kind == "error":
                errors[index] = error_for_number(result.error.code, result.error.message)
            elif kind in _wire.BATCH_ROWS:
                for row, error in _wire.batch_errors(getattr(result, kind)).items():
                    errors[index + row] = error_for_number(error.code, error.message)
            index += count
        return errors

    @property
    def ok(self) -> bool:
        """Whether every operation succeeded."""
        for _, result in self._spans():
            kind = result.WhichOneof("result")
            if kind == "error":
                return False
            if kind in _wire.BATCH_ROWS:
                batch = getattr(result, kind)
                if batch.errors or batch.num_run < batch.num_requests:
                    return False
        return True


class StepAnswer:
    """The answer of a step sent and not yet read: its ``StepResults`` or the typed
    error the call ended with, once known. ``PendingStep`` and ``AsyncPendingStep``
    add the ``result()`` that waits for it."""

    __slots__ = ("_done", "_error", "_results")

    def __init__(self) -> None:
        self._done = False
        self._results: StepResults | None = None
        self._error: KVServiceError | None = None

    def done(self) -> bool:
        """Whether the answer (or the error) has been read."""
        return self._done

    def resolve(self, results: StepResults) -> None:
        self._results, self._done = results, True

    def resolve_error(self, error: KVServiceError) -> None:
        self._error, self._done = error, True

    def _answer(self) -> StepResults:
        if self._error is not None:
            raise self._error
        assert self._results is not None
        return self._results


class PendingStep(StepAnswer):
    """A step sent on a session and not yet read (``Session.send``): ``result()``
    waits for its ``StepResults``, or raises the call's typed error, the same on
    every call."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[PendingStep], None]) -> None:
        super().__init__()
        # Reads answers until this step's is in.
        self._wait = wait

    def result(self) -> StepResults:
        if not self._done:
            self._wait(self)
        return self._answer()


# How long ``Handoff.put`` waits for the sending thread to take a message. Only a hint
# (the message is queued either way): the thread takes it as soon as it gets the GIL
# this wait releases, and waiting longer would not help while it is still sending the
# previous message, so the wait stays within one GIL switch interval.
HANDOFF_WAIT_S = 0.005


class Handoff(Generic[T]):
    """Messages from the thread that drives a session to the thread that sends them
    (gRPC's, for ``Session``; a step socket's writer), in order."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._taken = threading.Event()

    def put(self, item: T, *, wait: bool = True) -> None:
        """Queue ``item``; with ``wait``, wait (GIL released) until the sending thread
        has taken it: a caller that goes on computing would otherwise hold the GIL, and
        the message would leave only when the caller next blocks, up to a switch
        interval later."""
        self._taken.clear()
        self._items.put(item)
        if wait:
            self._taken.wait(HANDOFF_WAIT_S)

    def get(self) -> T:
        """The next item (the sending thread's side), waiting for one."""
        item = self._items.get()
        self._taken.set()
        return item


class StepSession(abc.ABC):
    """A blocking stream of steps: ``Session`` over gRPC, ``SocketSession`` on a step
    socket. Steps run in the order sent, each answered in order; ``with`` closes the
    stream, or cancels it when the block raised."""

    @abc.abstractmethod
    def send(self, builder: StepBuilder, *, stop_on_error: bool = False) -> PendingStep:
        """Send one step without waiting for its results: the server runs it while
        this thread goes on; ``result()`` waits for this one's answer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Read the answers still unread, half-close, and wait for the server to end
        the stream."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Drop the stream at once."""

    def step(self, builder: StepBuilder, *, stop_on_error: bool = False) -> StepResults:
        """Send one step and wait for its results."""
        return self.send(builder, stop_on_error=stop_on_error).result()

    def __enter__(self) -> Self:
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
