"""The one remote-step mechanism: a scheduler's replica answers every call at once,
and each step's operations go to the server as one message whose answers must equal
the replica's.

A scheduler asks its KV cache manager synchronously, once per request and step, and
acts on each answer before the next question (no room preempts, a hit sizes the
chunk): a round trip per question would cost hundreds per step. So the scheduler's
process keeps a replica of the server's pool, started from the same fresh pool, that
answers at once; the scheduler's adapter records every call that changed the pool,
in order, with the replica's answer (``StepLog``); at the step's end ``flush`` sends
them as one message, and every answer the server gives is compared with the
replica's. Both schedulers reach the server this way: vLLM's
(``kvservice.integrations.vllm.server_link``) and the reference scheduler
(``kvservice.scheduler.replicated``).

The server decides: a step it refuses, an answer that differs, or a server that
cannot be reached raises the link's error (naming the server, the operation and both
answers), and the link refuses every call after that: no state diverges silently.
A link checks a step before ``flush`` returns, or with ``overlap`` at the next
``flush`` (or ``confirm``), so the server runs a step while the scheduler plans the
next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from kvservice.client.errors import KVServiceError, RemoteStepError
from kvservice.client.step import StepBuilder, StepResults
from kvservice.client.step_log import (
    ANY_ANSWER,
    AllocationRun,
    Copies,
    Expected,
    LookupAllocationRun,
    Run,
    StepLog,
)
from kvservice.client.types import Allocation, RetentionChange


class SentStep(Protocol):
    """A step on its way: ``result()`` waits for its answers (``PendingStep``)."""

    def result(self) -> StepResults: ...


# Sends one step (stop_on_error on) without waiting for its answer, on a transport
# that runs steps in the order sent.
Send = Callable[[StepBuilder], SentStep]

# Applies to the replica the retention changes the server decided, when they are due.
ApplyRetention = Callable[[list[RetentionChange]], None]

# Step messages between the answer that carries a retention change and the one after
# whose operations the server applies it (the proto's StepResponse).
RETENTION_LAG = 1


def _copies(allocation: Allocation) -> Copies:
    """The copy-on-write copies the server answered an allocation with."""
    return allocation.block_copies_to_apply or allocation.block_copies_applied


class StepLink:
    """Records a step (``log``), sends it, and checks the server's answers against the
    replica's (see the module docstring).

    ``target`` names the server in messages; ``error`` is the exception type raised
    (a subclass of ``RemoteStepError`` an integration names its errors with);
    ``ordered``: the transport runs steps in the order sent (a stream), so a step may
    leave before the last one's answer is read (unary ``Step`` calls wait for it).
    ``apply_retention`` applies to the replica the retention changes a replica
    session's answers carry, at the point the server applies them: after the
    operations of the next message (the replica: as soon as it sent it).
    """

    def __init__(
        self,
        send: Send,
        target: str,
        *,
        overlap: bool = False,
        ordered: bool = True,
        keep_copy_holds: bool = False,
        error: type[RemoteStepError] = RemoteStepError,
        apply_retention: ApplyRetention | None = None,
    ) -> None:
        self._send = send
        self._apply_retention = apply_retention
        # Retention changes received, by the number of the message they are due at.
        self._retention_due: dict[int, list[RetentionChange]] = {}
        self.target = target
        self._overlap = overlap
        self._ordered = ordered
        self._keep_copy_holds = keep_copy_holds
        self._error = error
        self.log = StepLog(keep_copy_holds)
        # The step sent last and not yet checked, its expected answers, its size and
        # its number.
        self._unconfirmed: tuple[SentStep, list[Expected | Run], int, int] | None = None
        self._failure: RemoteStepError | None = None
        self.round_trips = 0

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def check_alive(self) -> None:
        """Refuse to go on after a failure: the replica and the server disagree."""
        if self._failure is not None:
            raise self._error(
                f"the KV cache manager stopped after an earlier failure: {self._failure}"
            )

    def flush(self) -> None:
        """Send the recorded operations as one step; check its answers now, or with
        ``overlap`` at the next ``flush``/``confirm``. Nothing recorded: nothing sent."""
        self.check_alive()
        if not self.log:
            return
        step, expected = self.log.build()
        self.log = StepLog(self._keep_copy_holds)
        self.round_trips += 1
        if not self._ordered:
            self.confirm()
        sent = self._send(step)
        self.confirm()  # ordered: the last step's answer comes before this one's
        self._unconfirmed = (sent, expected, len(step), self.round_trips)
        if not self._overlap:
            self.confirm()
        if self._retention_due:
            self._apply_due(self.round_trips)

    def _apply_due(self, sent: int) -> None:
        """The retention changes due after message ``sent``, in the order received."""
        due = self._retention_due
        ready = sorted(number for number in due if number <= sent)
        if ready and self._apply_retention is not None:
            self._apply_retention([change for number in ready for change in due.pop(number)])

    def confirm(self) -> None:
        """Wait for the last step sent and check its answers."""
        if self._unconfirmed is None:
            return
        sent, expected, num_ops, number = self._unconfirmed
        self._unconfirmed = None
        try:
            results = sent.result()
        except KVServiceError as error:
            self.fail(
                f"kvservice at {self.target}: Step of {num_ops} operations failed: {error}", error
            )
        self._compare(results, expected)
        if results.retention_changes:
            target = number + RETENTION_LAG
            self._retention_due.setdefault(target, []).extend(results.retention_changes)

    def fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        """Stop the link: raise ``message`` (from ``cause``), and refuse every call after
        this."""
        self._failure = self._error(message)
        raise self._failure from cause

    # -- checking -------------------------------------------------------------------------

    def _compare(self, results: StepResults, expected: list[Expected | Run]) -> None:
        if not results.ok:
            self._fail_refused(results, expected)
        for item in expected:
            if isinstance(item, AllocationRun):
                self._compare_run(results, item)
            elif isinstance(item, LookupAllocationRun):
                self._compare_lookup_run(results, item)
            elif not isinstance(item, Expected):
                continue  # frees and new requests answer nothing; a refusal failed above
            elif item.answer is not ANY_ANSWER:
                difference = self._difference(
                    item.view(results[item.handle]), item.answer, item.copies
                )
                if difference:
                    self._fail_answer(item.label, difference)

    # Speed: a run is checked on the response's columns, its entries decoded only when
    # they differ. With one-token appends kept as a column (StepLog.append_token), the
    # link's own cost (`python -m benchmarks.bench_decode_layers --requests 256 --steps
    # 100 --rounds 7 --layers step,link`, link minus step) fell from 0.90 to 0.69
    # us/request (one run each, 2026-12-05).
    def _compare_run(self, results: StepResults, run: AllocationRun) -> None:
        """A run's answers in bulk; entry by entry only to name the first that differs."""
        assert run.handle is not None
        if not any(run.copies) and results.allocations_match(run.handle, run.answers):
            return
        allocations = results.rows(run.handle)
        for row, allocation in enumerate(allocations):
            difference = self._difference(allocation, run.answers[row], run.copies[row])
            if difference:
                self._fail_answer(run.label(row), difference)

    def _compare_lookup_run(self, results: StepResults, run: LookupAllocationRun) -> None:
        """``_compare_run`` for admissions: each lookup's answer, then its allocation's."""
        assert run.handle is not None
        if not any(run.copies) and results.lookups_allocations_match(
            run.handle, run.hits, run.answers
        ):
            return
        for row, (hit, allocation) in enumerate(results.rows(run.handle)):
            difference = self._difference(hit, run.hits[row], ())
            if not difference:
                difference = self._difference(allocation, run.answers[row], run.copies[row])
            if difference:
                self._fail_answer(run.label(row), difference)

    @staticmethod
    def _difference(answer: Any, expected: Any, expected_copies: Copies) -> str:
        """How the server's ``answer`` differs from the replica's (empty: it does not)."""
        if isinstance(answer, Allocation):
            copies = _copies(answer)
            if copies != expected_copies:
                return f"the copies {copies!r}; the scheduler's replica queued {expected_copies!r}"
            answer = answer.new_block_ids
        if answer != expected:
            return (
                f"{answer!r}; the scheduler's replica answered {expected!r}. Is another "
                "client using this pool?"
            )
        return ""

    def _fail_answer(self, label: str, difference: str) -> NoReturn:
        self.fail(f"kvservice at {self.target} answered {label} with {difference}")

    def _fail_refused(self, results: StepResults, expected: list[Expected | Run]) -> NoReturn:
        """Name the operation the server refused first (under ``stop_on_error``, the
        later ones were not run)."""
        errors = results.errors
        if not errors:
            self.fail(f"kvservice at {self.target} refused a step")
        index = min(errors)
        error = errors[index]
        for item in expected:
            if not isinstance(item, Expected):
                assert item.handle is not None
                row = index - item.handle.index
                if 0 <= row < item.handle.num_entries:
                    self.fail(f"kvservice at {self.target} refused {item.label(row)}: {error}")
            elif item.handle.index == index:
                self.fail(f"kvservice at {self.target} refused {item.label}: {error}")
        self.fail(f"kvservice at {self.target} refused operation {index} of a step: {error}")
