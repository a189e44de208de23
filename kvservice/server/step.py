"""Running a batched step: every operation in order, each with its own result.

Failure semantics (the ``Step`` and ``StepStream`` contract):

* Each operation is atomic: a refused one changes nothing (the request table checks
  every argument before it mutates) and answers the status its unary RPC would have
  ended with, as an ``OperationError``.
* The step is not a transaction: operations before a failure stay applied, and the
  ones after it still run, because in vLLM's scheduler one request's refusal does not
  concern the others. ``stop_on_error`` instead answers every later operation
  CANCELLED without running it, for callers whose later operations depend on earlier
  ones.
* The step is isolated: it runs without any other call on the request table
  interleaving, and a cancelled call has either run entirely or not at all. A large
  step pauses every few milliseconds so that health checks and calls that do not touch
  the table go on, but keeps the table's turn meanwhile (``turns``); a cancellation
  during a pause takes effect once the step is done. Between its operations, and
  inside the ones that may carry thousands of entries (``admit``, the columnar
  batches: ``operations.SLICED_OPERATIONS``), between their entries.
* A step runs only under a live session: one whose session ended before it got the
  table's turn is refused as a whole (FAILED_PRECONDITION, nothing run), and one whose
  session ends during a pause (another of its streams broke, its lease was found run
  out) stops there: the operations already run stay applied, every later one answers
  FAILED_PRECONDITION without running, and the session's end then frees everything it
  owned, what the step added included. An ``admit`` or a batch whose session ends
  during one of its own pauses runs to its end first (it is one operation, and adds no
  request: what it allocated to the session's requests goes with them); the step
  stops before its next operation.
* With a co-located runtime, the blocks every ``allocate_slots`` of the step handed out
  are zeroed once, when the last operation has run and before the answer is sent
  (``RequestTable.batched``): one device op per step, not one per allocation, and no
  block id reaches a client before it reads as zeros. Should that zeroing fail (a
  device error), the whole step answers INTERNAL; its operations stay applied.
* Every operation acts for the caller of the ``Step`` or ``StepStream`` that carries
  it (its tenant, and its session for the requests it adds).
* Copy-on-write holds the step's allocations take are released when the step's
  answer is sent, or, with ``keep_copy_holds``, kept for the caller's session until it
  releases them (a ``free_retained_blocks`` operation, usually the next step's
  first), as vLLM's scheduler releases ``take_kv_cache_block_copies``' retained blocks.
* A step boundary (``new_step_starts``) is an operation like the others, ordered
  among them: a scheduler sends it after the previous step's frees and before the
  step's lookups, allocations and ``admit`` (which runs inside a step and starts none).

Columnar operations (``append_tokens_batch``, ``allocate_slots_batch``, ``free_batch``,
``lookup_allocate_batch``, ``add_request_batch``) carry a run of one-token appends, plain
allocations, frees, admissions (a lookup, then the allocation attaching its hit) or
plain new requests in one message and answer them column by column, with no protobuf
message per entry. Each entry runs exactly as its single
operation would, in order: a refused entry answers its own status in the batch's
``errors`` and changes nothing, and the later entries still run (NO_SPACE is an
answer, as always). Under ``stop_on_error`` a refused entry is a failure: the batch
stops there (``num_run`` counts it) and the step's later operations are not run. Only
a batch malformed as a whole (no entry, columns of different lengths) is refused as
an operation, before anything in it runs. Every entry counts against ``max_ops``, so
a batch cannot carry more work past the limit than single operations could. A batch
that is not run (stop_on_error) answers its own response with ``num_run`` 0, which
still says how many entries it held: a client reading handles per entry needs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import grpc
import structlog

from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError, KVCacheError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.server.caller import Caller
from kvservice.server.converters import retention_events_to_pb
from kvservice.server.errors import status_code_of, status_message_of
from kvservice.server.log import LineBudget
from kvservice.server.operations import (
    BATCH_OPERATIONS,
    SLICED_OPERATIONS,
    STEP_OPERATIONS,
    BatchOperation,
)
from kvservice.server.turns import WHOLE, Slices, TableTurn

log = structlog.get_logger("kvservice.step")


def code_number(code: grpc.StatusCode) -> int:
    """The wire number of a status code (grpc keeps it as ``value[0]``)."""
    number: int = code.value[0]
    return number


_CODE_NAMES = {code_number(c): c.name for c in grpc.StatusCode}
_CANCELLED = code_number(grpc.StatusCode.CANCELLED)
_NOT_RUN: Final = "not run: an earlier operation failed (stop_on_error)"
_INTERNAL = code_number(grpc.StatusCode.INTERNAL)
_INVALID_ARGUMENT = code_number(grpc.StatusCode.INVALID_ARGUMENT)

# (session id, tenant) -> None; raises the error saying why the session is not live.
SessionCheck = Callable[[str, str], None]


@dataclass(slots=True)
class StepRunner:
    """Runs ``StepRequest``s against one request table, in the table's turn."""

    table: RequestTable
    max_ops: int
    turn: TableTurn = field(default_factory=TableTurn)
    # Re-checks the caller's session in the turn: before the first operation and
    # after each pause (None: sessions are not checked, as in benchmarks).
    check_session: SessionCheck | None = None
    # Steps with refusals are logged within a budget (a line each, up to a rate).
    lines: LineBudget = field(default_factory=LineBudget)

    async def run(self, step: pb.StepRequest, response: pb.StepResponse, caller: Caller) -> None:
        """Run every operation of ``step`` for ``caller`` in order, answering into
        ``response`` (so a stream can fill its own wrapper message without a copy),
        pausing between operations every ``turns.SLICE_S`` of work with the table's
        turn held. Raises ``InvalidArgumentError`` (nothing run) for a step over
        ``max_ops`` operations, ``FailedPreconditionError`` (nothing run) for one that
        keeps copy holds without a session."""
        async with self.turn:
            slices = Slices()
            await self._run(step, response, caller, slices)
        slices.finish()

    def run_whole(self, step: pb.StepRequest, response: pb.StepResponse, caller: Caller) -> None:
        """``run`` without a loop and without pauses (benchmarks of the step path): the
        same work, the caller's thread owning the table meanwhile."""
        work = self._run(step, response, caller, WHOLE)
        try:
            work.send(None)
        except StopIteration:
            return
        raise RuntimeError("a step run whole paused")  # WHOLE is never due

    async def _run(
        self, step: pb.StepRequest, response: pb.StepResponse, caller: Caller, slices: Slices
    ) -> None:
        num_ops = _num_operations(step.ops)
        if num_ops > self.max_ops:
            raise InvalidArgumentError(
                f"step {step.step_id} has {num_ops} operations (each entry of a columnar "
                f"operation counted); the server accepts at most {self.max_ops} per step "
                f"(split it)"
            )
        session_id = caller.session_id
        check_session = self.check_session if session_id is not None else None
        if check_session is not None and session_id is not None:
            check_session(session_id, caller.tenant)  # ended: nothing run
        keep_holds = None
        if step.keep_copy_holds:
            if caller.session_id is None:
                raise FailedPreconditionError(
                    f"step {step.step_id} sets keep_copy_holds without a session; open one "
                    f"(OpenSession) so that the holds end with it if the client goes away"
                )
            keep_holds = (caller.tenant, caller.session_id)
        response.step_id = step.step_id
        replica = self.table.begin_replica_step(session_id)
        # Speed: hoisted out of the per-operation loop;
        # `python -m benchmarks.bench_decode_layers --requests 512 --steps 60 --layers step-single`:
        # step-single layer +7.2% us/request without (8.70 -> 9.33, medians of 11; 2026-12-03).
        add_result = response.results.add
        run_one = self._run_one
        sliced_operations = SLICED_OPERATIONS
        with_state = not step.omit_request_state
        stop_on_error = step.stop_on_error
        failed: Counter[int] = Counter()
        # Pauses after which the session was last checked.
        checked = slices.pauses
        # The pool is reported to the metrics once per step, not once per operation.
        with self.table.batched(keep_holds):
            for index, op in enumerate(step.ops):
                if slices.clock.due():
                    await slices.pause()
                if slices.pauses != checked and check_session is not None:
                    # Other tasks ran (a pause here, or inside the last operation).
                    checked = slices.pauses
                    ended = _session_error(check_session, session_id, caller.tenant)
                    if ended is not None:
                        # Its end frees what it owned once the turn is given back.
                        _answer_refused(step.ops[index:], add_result, *ended)
                        failed[ended[0]] += len(step.ops) - index
                        break
                result = add_result()
                kind = op.WhichOneof("op")
                if kind is None or (sliced := sliced_operations.get(kind)) is None:
                    code = run_one(op, kind, result, caller, with_state)
                else:
                    # Admit and the columnar batches pause between their entries. Each
                    # is one operation: once begun it runs to its end even if the
                    # session ends during one of its pauses (it adds no request, and
                    # the session's end, deferred until the turn is given back, frees
                    # whatever it allocated to the session's requests); the step stops
                    # before its next operation.
                    code = await self._run_sliced(
                        sliced, kind, op, result, caller, stop_on_error, with_state, slices
                    )
                if code:
                    _count_failures(failed, code, result)
                    if code == _INTERNAL:
                        log.error("step operation failed", step_id=step.step_id, op_index=index)
                    if stop_on_error:
                        # Answered without running, outside the loop: the hot path
                        # checks no flag per operation.
                        _answer_not_run(step.ops[index + 1 :], add_result)
                        failed[_CANCELLED] += len(step.ops) - index - 1
                        break
        if replica:
            retention_events_to_pb(self.table.end_replica_step(), response.retention_events)
        if failed:
            # One line per step, never one per operation (a step may hold thousands).
            codes = {_CODE_NAMES[c]: n for c, n in failed.items() if n}
            self.lines.info(
                log, "step refusals", step_id=step.step_id, num_ops=len(step.ops), codes=codes
            )

    def _run_one(
        self,
        op: pb.StepOperation,
        kind: str | None,
        result: pb.StepResult,
        caller: Caller,
        with_state: bool,
    ) -> int:
        """Run ``op`` (a per-request operation of oneof field ``kind``) into
        ``result``; the status code number, 0 when it succeeded."""
        if kind is None:
            _fail(result, _INVALID_ARGUMENT, "empty operation: set one field of StepOperation")
            return _INVALID_ARGUMENT
        operation = STEP_OPERATIONS[kind]
        # The operation answers straight into the result's field: no response message
        # built and then copied.
        out = getattr(result, kind)
        try:
            operation(self.table, getattr(op, kind), out, caller, with_state)
        except KVCacheError as err:
            code = code_number(status_code_of(err))
            _fail(result, code, status_message_of(err))
            return code
        except Exception:
            log.exception("step operation crashed", op=kind)
            _fail(result, _INTERNAL, "internal error; see the server log")
            return _INTERNAL
        # An answer of all default values (an empty block table...) sets no field, so
        # select it in the oneof explicitly.
        out.SetInParent()
        return 0

    async def _run_sliced(
        self,
        operation: BatchOperation,
        kind: str,
        op: pb.StepOperation,
        result: pb.StepResult,
        caller: Caller,
        stop_on_error: bool,
        with_state: bool,
        slices: Slices,
    ) -> int:
        """Run an operation that pauses between its entries (Admit, a columnar batch)
        into ``result``; for a batch its first refused entry's code."""
        out = getattr(result, kind)
        try:
            code = await operation(
                self.table, getattr(op, kind), out, caller, stop_on_error, with_state, slices
            )
        except KVCacheError as err:
            # Refused as a whole (a malformed batch, an Admit's arguments): nothing ran.
            code = code_number(status_code_of(err))
            _fail(result, code, status_message_of(err))
            return code
        except Exception:
            # Entries catch their own crashes; this is the operation's own code failing,
            # so entries before it may have run. Said as INTERNAL, as for any operation.
            log.exception("step operation crashed", op=kind)
            _fail(result, _INTERNAL, "internal error; see the server log")
            return _INTERNAL
        # An answer of all default values sets no field: select it in the oneof.
        out.SetInParent()
        return code


def _num_operations(ops: Sequence[pb.StepOperation]) -> int:
    """Operations against the per-step limit: each entry of a columnar operation
    counts as the single operation it stands for."""
    total = len(ops)
    for op in ops:
        kind = op.WhichOneof("op")
        if kind in BATCH_OPERATIONS:
            total += len(getattr(op, kind).request_ids) - 1
    return total


def _count_failures(failed: Counter[int], code: int, result: pb.StepResult) -> None:
    """Count a failed operation's refusals for the step's log line: a columnar one's
    refused entries one by one."""
    kind = result.WhichOneof("result")
    if kind in BATCH_OPERATIONS:
        for error in getattr(result, kind).errors:
            failed[error.code] += 1
    else:
        failed[code] += 1


def _answer_not_run(
    ops: Sequence[pb.StepOperation], add_result: Callable[[], pb.StepResult]
) -> None:
    """Answer operations skipped under stop_on_error: CANCELLED, or for a columnar one
    its own response with nothing run, which still tells how many entries it held."""
    for op in ops:
        kind = op.WhichOneof("op")
        result = add_result()
        if kind in BATCH_OPERATIONS:
            out = getattr(result, kind)
            out.num_requests = len(getattr(op, kind).request_ids)
            out.SetInParent()
        else:
            _fail(result, _CANCELLED, _NOT_RUN)


def _session_error(
    check: SessionCheck, session_id: str | None, tenant: str
) -> tuple[int, str] | None:
    """(code, message) when the step's session is no longer live, else None."""
    try:
        check(session_id or "", tenant)
    except KVCacheError as err:
        return code_number(status_code_of(err)), status_message_of(err)
    return None


def _answer_refused(
    ops: Sequence[pb.StepOperation],
    add_result: Callable[[], pb.StepResult],
    code: int,
    message: str,
) -> None:
    """Answer operations not run because the step's session ended: each its error."""
    for _ in ops:
        _fail(add_result(), code, message)


def _fail(result: pb.StepResult, code: int, message: str) -> None:
    result.error.code = code
    result.error.message = message
