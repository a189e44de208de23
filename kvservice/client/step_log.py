"""One scheduler step's pool operations, recorded with the answers a replica gave,
for ``StepLink`` to send as one ``Step`` and check.

A scheduler that keeps a replica of the server's pool (vLLM's scheduler over
kvservice's manager, the reference scheduler over a request table) gets every answer
at once from the replica, and records each call that changes the pool here, in
order, with that answer. The server must run the operations that touch the pool in
the order the replica ran them: frees, the step boundary (``new_step_starts``), the
lookups and allocations. New requests and token appends touch no block, and each
request's own come before its first use, so they go first: every new request, then
every append (the one-token appends of a decode step travel as one columnar
operation, and so do the plain allocations after them, instead of alternating).
The other runs a scheduler step makes travel as columnar operations too: the new
requests that carry nothing but a prompt (and vLLM's hashes), the frees of the
requests it finished, and the admissions of waiting requests (each a lookup and the
allocation that attaches its hit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvservice.client._wire import batchable
from kvservice.client.step import OpHandle, RunHandle, StepBuilder
from kvservice.client.types import (
    AllocateOptions,
    Allocation,
    BlockIds,
    ComputedBlocks,
    FreeMode,
)

Copies = tuple[tuple[int, int], ...]
RunT = TypeVar("RunT", bound="Run")


def _same(answer: Any) -> Any:
    return answer


@dataclass(frozen=True, slots=True)
class Expected:
    """One operation of a sent step: where its answer is, the replica's answer (or
    ``ANY_ANSWER``), and the call that made it, for a message that names it."""

    handle: OpHandle[Any]
    answer: Any
    method: str
    args: tuple[Any, ...]
    # An allocation's copy-on-write copies (src, dst), as the replica queued them.
    copies: Copies = ()
    # The server's answer in the form ``answer`` has (the replica may answer in its
    # own types: the reference scheduler's ``admit``).
    view: Callable[[Any], Any] = _same

    @property
    def label(self) -> str:
        return f"{self.method}({', '.join(repr(a) for a in self.args)})"


ANY_ANSWER = object()


# Speed: bulk recording and checking instead of an Expected per allocation;
# `python -m benchmarks.bench_decode_layers --requests 512 --steps 100 --layers link`:
# link layer +86% us/request without (3.59 -> 6.67, medians of 4 runs; measured 2026-12-03).
@dataclass(slots=True)
class AllocationRun:
    """Consecutive plain allocations (no hit, no options) of a sent step, column by
    column: the most common operation, which travels as one columnar entry each and is
    checked in bulk (``StepLink``)."""

    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # The replica's answers (None: no room) and each allocation's copies (src, dst).
    answers: list[BlockIds | None] = field(default_factory=list)
    copies: list[Copies] = field(default_factory=list)
    handle: RunHandle[Allocation | None] | None = None

    def label(self, row: int) -> str:
        return f"allocate_slots({self.request_ids[row]!r}, {self.num_new_tokens[row]})"

    def add_to(self, step: StepBuilder) -> None:
        self.handle = step.allocate_slots_batch(self.request_ids, self.num_new_tokens)


@dataclass(slots=True)
class LookupAllocationRun:
    """Consecutive admissions of waiting requests with the same options, each a
    lookup and the allocation that attaches its hit (vLLM's scheduler schedules a
    waiting request so): one ``lookup_allocate_batch`` entry each, checked in bulk."""

    # The options every allocation of the run shares (None: vLLM's defaults).
    options: AllocateOptions | None = None
    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # The replica's lookups, its allocations' answers (None: no room) and copies.
    hits: list[ComputedBlocks] = field(default_factory=list)
    answers: list[BlockIds | None] = field(default_factory=list)
    copies: list[Copies] = field(default_factory=list)
    handle: RunHandle[tuple[ComputedBlocks, Allocation | None]] | None = None

    def label(self, row: int) -> str:
        request_id = self.request_ids[row]
        return (
            f"get_computed_blocks({request_id!r}) then allocate_slots({request_id!r}, "
            f"{self.num_new_tokens[row]}) attaching its hit"
        )

    def add_to(self, step: StepBuilder) -> None:
        self.handle = step.lookup_allocate_batch(
            self.request_ids, self.num_new_tokens, self.options
        )


@dataclass(slots=True)
class FreeRun:
    """Consecutive frees (a step's finished and preempted requests): one
    ``free_batch`` entry each, which answers nothing but a refusal."""

    request_ids: list[str] = field(default_factory=list)
    modes: list[FreeMode] = field(default_factory=list)
    keep_blocks: list[bool] = field(default_factory=list)
    handle: RunHandle[None] | None = None

    def label(self, row: int) -> str:
        return f"free({self.request_ids[row]!r}, {self.modes[row]!r}, {self.keep_blocks[row]!r})"

    def add_to(self, step: StepBuilder) -> None:
        self.handle = step.free_batch(self.request_ids, self.modes, self.keep_blocks)


@dataclass(slots=True)
class AddRequestRun:
    """New requests with nothing but a prompt (and vLLM's hashes, or none of them
    with any): one ``add_request_batch`` entry each, which answers nothing but a
    refusal."""

    # Whether the requests carry their block hashes (client_hashed).
    hashed: bool
    request_ids: list[str] = field(default_factory=list)
    prompts: list[Sequence[int]] = field(default_factory=list)
    block_hashes: list[Sequence[bytes]] = field(default_factory=list)
    handle: RunHandle[None] | None = None

    def label(self, row: int) -> str:
        return f"add_request({self.request_ids[row]!r}, <{len(self.prompts[row])} tokens>)"

    def add_to(self, step: StepBuilder) -> bool:
        """Add the run as a batch (True), or, when a prompt holds an id that does not
        pack, as single requests that send it for the server to name (False)."""
        hashes = self.block_hashes if self.hashed else None
        try:
            self.handle = step.add_request_batch(self.request_ids, self.prompts, hashes)
        except ValueError:
            for row, request_id in enumerate(self.request_ids):
                step.add_request(
                    request_id, self.prompts[row], block_hashes=hashes[row] if hashes else None
                )
            return False
        return True


# A recorded run of entries of one columnar operation.
Run = AllocationRun | LookupAllocationRun | FreeRun | AddRequestRun

# A recorded operation: (StepBuilder method, its arguments, the replica's answer, its
# copies, the view of the server's answer), or a run.
_Op = tuple[str, tuple[Any, ...], Any, Copies, Callable[[Any], Any]] | Run


class StepLog:
    """The operations recorded since the last send (see the module docstring).

    ``keep_copy_holds``: the step keeps its copy holds until the replica's scheduler
    releases them (vLLM's does, with ``free_retained_blocks``).
    """

    def __init__(self, keep_copy_holds: bool = False) -> None:
        self._keep_copy_holds = keep_copy_holds
        # The new requests: runs of plain ones, and (request id, prompt,
        # StepBuilder.add_request's keyword arguments) for the others.
        self._new: list[AddRequestRun | tuple[str, Sequence[int], dict[str, Any]]] = []
        # One token each: the decode step's appends, sent as one columnar operation.
        self._ones: dict[str, int] = {}
        # Several tokens, or a request's second append of the step.
        self._appends: dict[str, list[int]] = {}
        # A client_hashed request's hashes of the blocks its appends complete.
        self._appended_hashes: dict[str, list[bytes]] = {}
        self._ops: list[_Op] = []
        # The last of _ops while it is a run that the next operation of its kind joins.
        self._run: Run | None = None
        # The hit of the last of _ops while it is a lookup that an allocation may
        # join (into a LookupAllocationRun), and its request.
        self._lookup: tuple[str, ComputedBlocks] | None = None

    def __bool__(self) -> bool:
        return bool(self._new or self._ones or self._appends or self._ops)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], **kwargs: Any) -> None:
        """``StepBuilder.add_request(request_id, prompt_token_ids, **kwargs)``: a plain
        request (no argument but ``block_hashes`` set) as an ``add_request_batch``
        entry, any other on its own."""
        hashes = kwargs.get("block_hashes")
        if kwargs.get("cache_control_ttl") is not None or any(
            value for name, value in kwargs.items() if name != "block_hashes"
        ):
            self._new.append((request_id, prompt_token_ids, kwargs))
            return
        hashed = hashes is not None
        run = self._new[-1] if self._new else None
        if not isinstance(run, AddRequestRun) or run.hashed != hashed:
            run = AddRequestRun(hashed)
            self._new.append(run)
        run.request_ids.append(request_id)
        run.prompts.append(prompt_token_ids)
        run.block_hashes.append(hashes or ())

    def append_token(self, request_id: str, token_id: int) -> None:
        """``append_tokens(request_id, [token_id])``: a decode step's, recorded as a
        column entry."""
        tokens = self._appends.get(request_id)
        if tokens is not None:
            tokens.append(token_id)
        elif request_id in self._ones:
            self._appends[request_id] = [self._ones.pop(request_id), token_id]
        else:
            self._ones[request_id] = token_id

    def append_tokens(
        self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
    ) -> None:
        if len(token_ids) == 1:
            if not block_hashes:
                self.append_token(request_id, token_ids[0])
                return
            if request_id not in self._ones and request_id not in self._appends:
                # A decode token that completes a block: a column entry with its hash.
                self._ones[request_id] = token_ids[0]
                self._appended_hashes[request_id] = list(block_hashes)
                return
        tokens = self._appends.get(request_id)
        if tokens is None:
            one = self._ones.pop(request_id, None)
            tokens = self._appends[request_id] = [] if one is None else [one]
        tokens.extend(token_ids)
        if block_hashes:
            self._appended_hashes.setdefault(request_id, []).extend(block_hashes)

    def record(
        self,
        method: str,
        args: tuple[Any, ...],
        answer: Any,
        copies: Copies = (),
        view: Callable[[Any], Any] = _same,
    ) -> None:
        """An operation on the pool: ``StepBuilder.<method>(*args)``, whose answer (seen
        through ``view``) must equal ``answer`` (``ANY_ANSWER``: only succeed), and for
        an allocation whose copy-on-write copies must be ``copies``."""
        self._ops.append((method, args, answer, copies, view))
        self._run = None
        self._lookup = None

    def lookup(self, request_id: str, hit: ComputedBlocks) -> None:
        """``get_computed_blocks(request_id)`` (no cap) answered ``hit``; the
        allocation that attaches it, recorded next, joins it (``allocate``)."""
        self.record("get_computed_blocks", (request_id,), hit)
        self._lookup = (request_id, hit)

    def allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        answer: BlockIds | None,
        copies: Copies = (),
        hit: ComputedBlocks | None = None,
        options: AllocateOptions | None = None,
    ) -> None:
        """An ``allocate_slots`` that attaches ``hit`` (None: no hit) with ``options``
        (None: vLLM's defaults) and answered ``answer``. Right after the lookup that
        answered ``hit`` (or one that hit nothing, when it attaches none), the two
        travel as one ``lookup_allocate_batch`` entry; a plain allocation (no hit, no
        options) as an ``allocate_slots_batch`` entry; any other on its own."""
        lookup = self._lookup
        if (
            lookup is not None
            and lookup[0] == request_id
            and (options is None or batchable(options))
            and (lookup[1] == hit if hit is not None else not lookup[1].num_computed_tokens)
        ):
            self._join_lookup(request_id, num_new_tokens, lookup[1], options, answer, copies)
            return
        if hit is not None or options is not None:
            args = (request_id, num_new_tokens, hit, options)
            self.record("allocate_slots", args, answer, copies)
            return
        run = self._run
        if not isinstance(run, AllocationRun):
            run = self._open(AllocationRun())
        run.request_ids.append(request_id)
        run.num_new_tokens.append(num_new_tokens)
        run.answers.append(answer)
        run.copies.append(copies)

    def _join_lookup(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks,
        options: AllocateOptions | None,
        answer: BlockIds | None,
        copies: Copies,
    ) -> None:
        """Replace the last operation, the lookup, with an entry of a
        LookupAllocationRun (the one before it, when it is one with these options)."""
        self._ops.pop()
        run = self._ops[-1] if self._ops else None
        if not isinstance(run, LookupAllocationRun) or run.options != options:
            run = LookupAllocationRun(options)
        run = self._open(run)
        run.request_ids.append(request_id)
        run.num_new_tokens.append(num_new_tokens)
        run.hits.append(hit)
        run.answers.append(answer)
        run.copies.append(copies)

    def free(self, request_id: str, mode: FreeMode, keep_blocks: bool = False) -> None:
        """``free(request_id, mode, keep_blocks)``, which answers nothing to check."""
        run = self._run
        if not isinstance(run, FreeRun):
            run = self._open(FreeRun())
        run.request_ids.append(request_id)
        run.modes.append(mode)
        run.keep_blocks.append(keep_blocks)

    def _open(self, run: RunT) -> RunT:
        """``run`` as the last operation, which the next operation of its kind joins."""
        if not self._ops or self._ops[-1] is not run:
            self._ops.append(run)
        self._run = run
        self._lookup = None
        return run

    def build(self) -> tuple[StepBuilder, list[Expected | Run]]:
        """The step to send, and what each recorded operation must answer."""
        step = StepBuilder(omit_request_state=True, keep_copy_holds=self._keep_copy_holds)
        expected: list[Expected | Run] = []
        for new in self._new:
            if isinstance(new, AddRequestRun):
                if new.add_to(step):
                    expected.append(new)
            else:
                request_id, prompt, kwargs = new
                step.add_request(request_id, prompt, **kwargs)
        # One token each (with the hash of the block it completes, for a client_hashed
        # request): the decode step's columnar batch. An append of several tokens
        # travels alone.
        hashes = self._appended_hashes
        ones = self._ones
        column_hashes = [hashes.get(r, ()) for r in ones] if hashes else None
        step.append_tokens_batch(list(ones), list(ones.values()), column_hashes)
        for request_id, tokens in self._appends.items():
            step.append_tokens(request_id, tokens, hashes.get(request_id, ()))
        for op in self._ops:
            if not isinstance(op, tuple):
                op.add_to(step)
                expected.append(op)
            else:
                method, args, answer, copies, view = op
                expected.append(
                    Expected(getattr(step, method)(*args), answer, method, args, copies, view)
                )
        return step, expected
