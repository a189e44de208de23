"""One scheduler step's pool operations, recorded with the answers the replica gave,
for the remote manager to send as one ``Step``.

The server must run the operations that touch the pool in the order the replica ran
them. New requests and token appends touch no block, and each request's own come
before its first use, so they go first: every new request, then every append (the
one-token appends of a decode step travel as one columnar operation, and so do the
plain allocations after them, instead of alternating).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvservice.client import OpHandle, StepBuilder


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

    @property
    def label(self) -> str:
        return f"{self.method}({', '.join(repr(a) for a in self.args)})"


ANY_ANSWER = object()


@dataclass(frozen=True, slots=True)
class _NewRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None
    lora_name: str | None
    skip_reading_prefix_cache: bool


class StepLog:
    """The operations recorded since the last send (see the module docstring)."""

    def __init__(self) -> None:
        self._new: list[_NewRequest] = []
        self._appends: dict[str, list[int]] = {}
        # (StepBuilder method, its arguments, the replica's answer)
        self._ops: list[tuple[str, tuple[Any, ...], Any]] = []

    def __bool__(self) -> bool:
        return bool(self._new or self._appends or self._ops)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        lora_name: str | None,
        skip_reading_prefix_cache: bool,
    ) -> None:
        self._new.append(
            _NewRequest(
                request_id, prompt_token_ids, cache_salt, lora_name, skip_reading_prefix_cache
            )
        )

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._appends.setdefault(request_id, []).extend(token_ids)

    def record(self, method: str, args: tuple[Any, ...], answer: Any) -> None:
        """An operation on the pool: ``StepBuilder.<method>(*args)``, whose answer must
        equal ``answer`` (``ANY_ANSWER``: only succeed)."""
        self._ops.append((method, args, answer))

    def build(self) -> tuple[StepBuilder, list[Expected]]:
        """The step to send, and what each recorded operation must answer."""
        step = StepBuilder(omit_request_state=True)
        for new in self._new:
            step.add_request(
                new.request_id,
                new.prompt_token_ids,
                cache_salt=new.cache_salt,
                lora_name=new.lora_name,
                skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            )
        appends = self._appends.items()
        for request_id, tokens in appends:
            if len(tokens) == 1:
                step.append_tokens(request_id, tokens)
        for request_id, tokens in appends:
            if len(tokens) > 1:
                step.append_tokens(request_id, tokens)
        expected = [
            Expected(getattr(step, method)(*args), answer, method, args)
            for method, args, answer in self._ops
        ]
        return step, expected
