"""One scheduler step's pool operations, recorded with the answers the replica gave,
for the remote manager to send as one ``Step``.

The server must run the operations that touch the pool in the order the replica ran
them: the releases of the last step's copy holds, its frees, the step boundary
(``new_step_starts``), then the step's lookups and allocations. New requests and token
appends touch no block, and each request's own come before its first use, so they go
first: every new request, then every append (the one-token appends of a decode step
travel as one columnar operation, and so do the plain allocations after them, instead
of alternating). Every step keeps its copy holds (``keep_copy_holds``) until the
replica's scheduler releases them, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvservice.client import Allocation, MultiModalFeature, OpHandle, RunHandle, StepBuilder

BlockIds = tuple[tuple[int, ...], ...]


# Not frozen: one is made per operation of every step sent, and a frozen dataclass's
# __init__ costs several times a plain one's.
@dataclass(slots=True)
class Expected:
    """One operation of a sent step: where its answer is, the replica's answer (or
    ``ANY_ANSWER``), and the call that made it, for a message that names it."""

    handle: OpHandle[Any]
    answer: Any
    method: str
    args: tuple[Any, ...]
    # An allocation's copy-on-write copies (src, dst), as the replica queued them.
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.method}({', '.join(repr(a) for a in self.args)})"


ANY_ANSWER = object()


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What ``add_request`` sends of a vLLM request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None
    lora_name: str | None
    skip_reading_prefix_cache: bool
    lora_path: str | None = None
    lora_int_id: int | None = None
    prompt_embeds: bytes | None = None
    prompt_embeds_row_bytes: int = 0
    mm_features: Sequence[MultiModalFeature] = ()


@dataclass(slots=True)
class AllocationRun:
    """Consecutive plain allocations (no hit, no options) of a sent step, column by
    column: the most common operation, which travels as one columnar entry each and is
    checked in bulk (``ServerLink``)."""

    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # The replica's answers (None: no room) and each allocation's copies (src, dst).
    answers: list[BlockIds | None] = field(default_factory=list)
    copies: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    handle: RunHandle[Allocation | None] | None = None

    def label(self, row: int) -> str:
        return f"allocate_slots({self.request_ids[row]!r}, {self.num_new_tokens[row]})"


class StepLog:
    """The operations recorded since the last send (see the module docstring)."""

    def __init__(self) -> None:
        self._new: list[NewRequest] = []
        self._appends: dict[str, list[int]] = {}
        # (StepBuilder method, its arguments, the replica's answer, its copies), or a
        # run of plain allocations.
        self._ops: list[
            tuple[str, tuple[Any, ...], Any, tuple[tuple[int, int], ...]] | AllocationRun
        ] = []
        # The last of _ops while it is a run that the next plain allocation joins.
        self._run: AllocationRun | None = None

    def __bool__(self) -> bool:
        return bool(self._new or self._appends or self._ops)

    def add_request(self, new: NewRequest) -> None:
        self._new.append(new)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._appends.setdefault(request_id, []).extend(token_ids)

    def record(
        self,
        method: str,
        args: tuple[Any, ...],
        answer: Any,
        copies: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """An operation on the pool: ``StepBuilder.<method>(*args)``, whose answer must
        equal ``answer`` (``ANY_ANSWER``: only succeed), and for an allocation whose
        copy-on-write copies must be ``copies``."""
        self._ops.append((method, args, answer, copies))
        self._run = None

    def allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        answer: BlockIds | None,
        copies: tuple[tuple[int, int], ...],
    ) -> None:
        """A plain ``allocate_slots`` (no hit, no options) that answered ``answer``."""
        run = self._run
        if run is None:
            run = self._run = AllocationRun()
            self._ops.append(run)
        run.request_ids.append(request_id)
        run.num_new_tokens.append(num_new_tokens)
        run.answers.append(answer)
        run.copies.append(copies)

    def build(self) -> tuple[StepBuilder, list[Expected | AllocationRun]]:
        """The step to send, and what each recorded operation must answer."""
        step = StepBuilder(omit_request_state=True, keep_copy_holds=True)
        for new in self._new:
            step.add_request(
                new.request_id,
                new.prompt_token_ids,
                cache_salt=new.cache_salt,
                lora_name=new.lora_name,
                mm_features=new.mm_features,
                skip_reading_prefix_cache=new.skip_reading_prefix_cache,
                lora_path=new.lora_path,
                lora_int_id=new.lora_int_id,
                prompt_embeds=new.prompt_embeds,
                prompt_embeds_row_bytes=new.prompt_embeds_row_bytes,
            )
        appends = self._appends
        ones = [request_id for request_id, tokens in appends.items() if len(tokens) == 1]
        step.append_tokens_batch(ones, [appends[request_id][0] for request_id in ones])
        for request_id, tokens in appends.items():
            if len(tokens) > 1:
                step.append_tokens(request_id, tokens)
        expected: list[Expected | AllocationRun] = []
        for op in self._ops:
            if isinstance(op, AllocationRun):
                op.handle = step.allocate_slots_batch(op.request_ids, op.num_new_tokens)
                expected.append(op)
            else:
                method, args, answer, copies = op
                expected.append(
                    Expected(getattr(step, method)(*args), answer, method, args, copies)
                )
        return step, expected
