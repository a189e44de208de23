"""Running a batched step: every operation in order, each with its own result.

Failure semantics (the ``Step`` and ``StepStream`` contract):

* Each operation is atomic: a refused one changes nothing (the allocator checks every
  argument before it mutates) and answers the status its unary RPC would have ended
  with, as an ``OperationError``.
* The step is not a transaction: operations before a failure stay applied, and the
  ones after it still run, because in vLLM's scheduler one request's refusal does not
  concern the others. ``stop_on_error`` instead answers every later operation
  CANCELLED without running it, for callers whose later operations depend on earlier
  ones.
* The step is isolated: no operation awaits, so the whole step runs without any other
  call interleaving, and a cancelled call has either run entirely or not at all.
* With a co-located runtime, the blocks every ``allocate_slots`` of the step handed out
  are zeroed once, when the last operation has run and before the answer is sent
  (``Allocator.batched``): one device op per step, not one per allocation, and no
  block id reaches a client before it reads as zeros. Should that zeroing fail (a
  device error), the whole step answers INTERNAL; its operations stay applied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import grpc
import structlog

from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.server.allocator import Allocator
from kvservice.server.errors import status_code_of, status_message_of
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.operations import (
    STEP_OPERATIONS,
    STEP_OPERATIONS_WITHOUT_STATE,
    Operation,
    current_tenant,
)

log = structlog.get_logger("kvservice.step")


def code_number(code: grpc.StatusCode) -> int:
    """The wire number of a status code (grpc keeps it as ``value[0]``)."""
    number: int = code.value[0]
    return number


_CODE_NAMES = {code_number(c): c.name for c in grpc.StatusCode}
_CANCELLED = code_number(grpc.StatusCode.CANCELLED)
_NOT_RUN = "not run: an earlier operation failed (stop_on_error)"
_INTERNAL = code_number(grpc.StatusCode.INTERNAL)
_INVALID_ARGUMENT = code_number(grpc.StatusCode.INVALID_ARGUMENT)


@dataclass(slots=True)
class StepRunner:
    """Runs ``StepRequest``s against one allocator."""

    allocator: Allocator
    max_ops: int

    def run(self, step: pb.StepRequest, response: pb.StepResponse) -> None:
        """Run every operation of ``step`` in order, answering into ``response`` (so a
        stream can fill its own wrapper message without a copy). Raises
        ``InvalidArgumentError`` (nothing run) for a step over ``max_ops`` operations."""
        if len(step.ops) > self.max_ops:
            raise InvalidArgumentError(
                f"step {step.step_id} has {len(step.ops)} operations; the server accepts at "
                f"most {self.max_ops} per step (split it)"
            )
        response.step_id = step.step_id
        add_result = response.results.add
        run_one = self._run_one
        table = _OPERATIONS_WITHOUT_STATE if step.omit_request_state else _OPERATIONS
        # Every operation of a step acts for the tenant of the call carrying it.
        tenant = current_tenant()
        failed: Counter[int] = Counter()
        # The pool is reported to the metrics once per step, not once per operation.
        with self.allocator.batched():
            for index, op in enumerate(step.ops):
                code = run_one(op, add_result(), table, tenant)
                if code:
                    failed[code] += 1
                    if code == _INTERNAL:
                        log.error("step operation failed", step_id=step.step_id, op_index=index)
                    if step.stop_on_error:
                        # Answered without running, outside the loop: the hot path
                        # checks no flag per operation.
                        for _ in range(index + 1, len(step.ops)):
                            _fail(add_result(), _CANCELLED, _NOT_RUN)
                        failed[_CANCELLED] += len(step.ops) - index - 1
                        break
        if failed:
            # One line per step, never one per operation (a step may hold thousands).
            codes = {_CODE_NAMES[c]: n for c, n in failed.items() if n}
            log.info("step refusals", step_id=step.step_id, num_ops=len(step.ops), codes=codes)

    def _run_one(
        self,
        op: pb.StepOperation,
        result: pb.StepResult,
        table: dict[str | None, Operation],
        tenant: str,
    ) -> int:
        """Run ``op`` into ``result``; the status code number, 0 when it succeeded."""
        kind = op.WhichOneof("op")
        operation = table.get(kind)
        if kind is None or operation is None:
            _fail(result, _INVALID_ARGUMENT, "empty operation: set one field of StepOperation")
            return _INVALID_ARGUMENT
        # The operation answers straight into the result's field: no response message
        # built and then copied.
        out = getattr(result, kind)
        try:
            operation(self.allocator, getattr(op, kind), out, tenant)
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


# Keyed by str | None, so that an empty operation (no oneof field set) looks up too.
_OPERATIONS: dict[str | None, Operation] = {k: f for k, f in STEP_OPERATIONS.items()}
_OPERATIONS_WITHOUT_STATE: dict[str | None, Operation] = {
    k: f for k, f in STEP_OPERATIONS_WITHOUT_STATE.items()
}


def _fail(result: pb.StepResult, code: int, message: str) -> None:
    result.error.code = code
    result.error.message = message
