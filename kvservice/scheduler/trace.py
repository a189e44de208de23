"""Run traces: every ``Backend`` call of a run and its answer, as JSON lines.

``TracingBackend`` records while a scheduler runs; ``write_trace`` / ``read_trace``
store it (a header line, then one line per call); ``replay`` issues the same calls
against another backend and ``check_replay`` fails at the first answer that differs.
A trace replays without the scheduler, so it pins the allocator's behaviour alone.

Version 2 added ``admit`` (a step's admissions in one call), version 3
``new_step_starts`` (a step boundary); an older trace holds only the other calls,
which replay as before (a pool never told of steps treats each allocation as a step
of its own), so it is still read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvservice.client.types import AdmitOptions
from kvservice.scheduler.backend import (
    AdmittedIds,
    AllocatedIds,
    Backend,
    BlockIds,
    ForwardingBackend,
    PendingBlockIds,
    PrefixHit,
    resolve_ids,
)

TRACE_FORMAT = "kvservice-trace"
TRACE_VERSION = 3
# Versions read_trace accepts: every call of an older one replays as it did.
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One backend call: the method, its arguments and its answer, as JSON values."""

    op: str
    args: dict[str, Any]
    result: Any = None

    def to_json(self) -> str:
        return json.dumps({"op": self.op, "args": self.args, "result": self.result})


@dataclass(frozen=True, slots=True)
class Trace:
    """A header (free-form run metadata) and the calls in order."""

    meta: dict[str, Any] = field(default_factory=dict)
    entries: tuple[TraceEntry, ...] = ()


class TraceMismatchError(AssertionError):
    """A replayed call answered differently from the recording."""


def _ids_to_json(block_ids: BlockIds | None) -> list[list[int]] | None:
    return None if block_ids is None else [list(group) for group in block_ids]


def _ids_from_json(value: Any) -> BlockIds | None:
    return None if value is None else tuple(tuple(int(b) for b in group) for group in value)


def _hit_to_json(hit: PrefixHit | None) -> dict[str, Any] | None:
    if hit is None:
        return None
    return {
        "block_ids": _ids_to_json(hit.block_ids),
        "num_computed_tokens": hit.num_computed_tokens,
        "shared_prefix_boundary": hit.shared_prefix_boundary,
    }


def _hit_from_json(value: Any) -> PrefixHit | None:
    if value is None:
        return None
    return PrefixHit(
        _ids_from_json(value["block_ids"]) or (),
        int(value["num_computed_tokens"]),
        int(value["shared_prefix_boundary"]),
    )


def _admitted_to_json(admitted: Sequence[AdmittedIds]) -> list[dict[str, Any]]:
    """``admit``'s answer; its block ids must be resolved (after ``flush``)."""
    return [
        {
            "request_id": item.request_id,
            "num_hit_tokens": item.num_hit_tokens,
            "num_new_tokens": item.num_new_tokens,
            "new_block_ids": _ids_to_json(resolve_ids(item.new_block_ids)),
        }
        for item in admitted
    ]


def _admit_args(
    request_ids: Sequence[str], token_budget: int, options: AdmitOptions
) -> dict[str, Any]:
    return {
        "request_ids": list(request_ids),
        "token_budget": token_budget,
        "enable_chunked_prefill": options.enable_chunked_prefill,
        "num_lookahead_tokens": options.num_lookahead_tokens,
        "full_sequence_must_fit": options.full_sequence_must_fit,
    }


def _admit(backend: Backend, args: dict[str, Any]) -> list[AdmittedIds]:
    """A recorded ``admit`` issued again."""
    return backend.admit(
        [str(request_id) for request_id in args["request_ids"]],
        int(args["token_budget"]),
        AdmitOptions(
            enable_chunked_prefill=bool(args["enable_chunked_prefill"]),
            num_lookahead_tokens=int(args["num_lookahead_tokens"]),
            full_sequence_must_fit=bool(args["full_sequence_must_fit"]),
        ),
    )


def _any_pending(admitted: Sequence[AdmittedIds]) -> bool:
    return any(isinstance(item.new_block_ids, PendingBlockIds) for item in admitted)


class TracingBackend(ForwardingBackend):
    """A ``Backend`` that forwards every call to ``inner`` and records it."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.entries: list[TraceEntry] = []
        # Entries whose answer a batching backend gives only at the next flush: the
        # entry's index and how to write its answer then.
        self._unresolved: list[tuple[int, Callable[[], Any]]] = []

    def _record(self, op: str, args: dict[str, Any], result: Any = None) -> None:
        self.entries.append(TraceEntry(op, args, result))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        super().add_request(request_id, prompt_token_ids)
        self._record(
            "add_request", {"request_id": request_id, "prompt_token_ids": list(prompt_token_ids)}
        )

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self._record("new_step_starts", {})

    def get_computed_blocks(self, request_id: str) -> PrefixHit:
        hit = super().get_computed_blocks(request_id)
        self._record("get_computed_blocks", {"request_id": request_id}, _hit_to_json(hit))
        return hit

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> AllocatedIds | None:
        new_block_ids = super().allocate_slots(
            request_id, num_new_tokens, hit, num_lookahead_tokens, full_sequence_must_fit
        )
        args = {
            "request_id": request_id,
            "num_new_tokens": num_new_tokens,
            "hit": _hit_to_json(hit),
            "num_lookahead_tokens": num_lookahead_tokens,
            "full_sequence_must_fit": full_sequence_must_fit,
        }
        if isinstance(new_block_ids, PendingBlockIds):
            pending = new_block_ids
            self._unresolved.append((len(self.entries), lambda: _ids_to_json(pending.get())))
            self._record("allocate_slots", args)
        else:
            self._record("allocate_slots", args, _ids_to_json(new_block_ids))
        return new_block_ids

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions,
    ) -> list[AdmittedIds]:
        args = _admit_args(request_ids, token_budget, options)
        admitted = super().admit(request_ids, token_budget, options)
        if _any_pending(admitted):
            self._unresolved.append((len(self.entries), lambda: _admitted_to_json(admitted)))
            self._record("admit", args)
        else:
            self._record("admit", args, _admitted_to_json(admitted))
        return admitted

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        super().append_tokens(request_id, token_ids)
        self._record("append_tokens", {"request_id": request_id, "token_ids": list(token_ids)})

    def free(self, request_id: str, preempt: bool = False) -> None:
        super().free(request_id, preempt)
        self._record("free", {"request_id": request_id, "preempt": preempt})

    def num_free_blocks(self) -> int:
        num_free = super().num_free_blocks()
        self._record("num_free_blocks", {}, num_free)
        return num_free

    def end_step(self) -> None:
        super().end_step()
        self._resolve_answers()

    def flush(self) -> None:
        super().flush()
        self._resolve_answers()

    def _resolve_answers(self) -> None:
        for index, answer in self._unresolved:
            entry = self.entries[index]
            self.entries[index] = TraceEntry(entry.op, entry.args, answer())
        self._unresolved.clear()

    def trace(self, meta: dict[str, Any] | None = None) -> Trace:
        """What was recorded so far."""
        return Trace(dict(meta or {}), tuple(self.entries))


def write_trace(path: Path, trace: Trace) -> None:
    """Store ``trace`` as JSON lines: the header, then one call per line."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": trace.meta}
    lines = [json.dumps(header), *(entry.to_json() for entry in trace.entries)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_trace(path: Path) -> Trace:
    """Load a trace ``write_trace`` stored; ValueError for another format or version."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty trace")
    header = json.loads(lines[0])
    version = header.get("version")
    if header.get("format") != TRACE_FORMAT or version not in READABLE_VERSIONS:
        raise ValueError(
            f"{path}: not a {TRACE_FORMAT} file of version {READABLE_VERSIONS} "
            f"(format {header.get('format')!r}, version {version!r})"
        )
    entries = []
    for line in lines[1:]:
        raw = json.loads(line)
        entries.append(TraceEntry(str(raw["op"]), dict(raw["args"]), raw.get("result")))
    return Trace(dict(header.get("meta", {})), tuple(entries))


def _apply(backend: Backend, entry: TraceEntry) -> Any:
    """Issue one recorded call; its answer as the trace stores it."""
    args = entry.args
    match entry.op:
        case "add_request":
            backend.add_request(str(args["request_id"]), [int(t) for t in args["prompt_token_ids"]])
            return None
        case "new_step_starts":
            backend.new_step_starts()
            return None
        case "get_computed_blocks":
            return _hit_to_json(backend.get_computed_blocks(str(args["request_id"])))
        case "allocate_slots":
            new_block_ids = backend.allocate_slots(
                str(args["request_id"]),
                int(args["num_new_tokens"]),
                _hit_from_json(args["hit"]),
                int(args["num_lookahead_tokens"]),
                bool(args["full_sequence_must_fit"]),
            )
            if isinstance(new_block_ids, PendingBlockIds):
                backend.flush()  # a batching backend: its answer comes with the send
            return None if new_block_ids is None else _ids_to_json(resolve_ids(new_block_ids))
        case "admit":
            admitted = _admit(backend, args)
            if _any_pending(admitted):
                backend.flush()  # a batching backend: its answer comes with the send
            return _admitted_to_json(admitted)
        case "append_tokens":
            backend.append_tokens(str(args["request_id"]), [int(t) for t in args["token_ids"]])
            return None
        case "free":
            backend.free(str(args["request_id"]), bool(args["preempt"]))
            return None
        case "num_free_blocks":
            return backend.num_free_blocks()
        case _:
            raise ValueError(f"unknown trace operation {entry.op!r}")


def replay(entries: Iterable[TraceEntry], backend: Backend) -> list[Any]:
    """Issue every recorded call against ``backend``; the answers, in order."""
    return [_apply(backend, entry) for entry in entries]


def _subject(entry: TraceEntry) -> Any:
    """The request(s) a call is about, for an error message."""
    return entry.args.get("request_id", entry.args.get("request_ids", ""))


def check_replay(trace: Trace, backend: Backend) -> int:
    """Replay ``trace`` against ``backend``, raising ``TraceMismatchError`` at the first
    answer that differs from the recording; the number of calls replayed."""
    for index, entry in enumerate(trace.entries):
        result = _apply(backend, entry)
        if result != entry.result:
            raise TraceMismatchError(
                f"call {index} ({entry.op} {_subject(entry)!r}): recorded "
                f"{entry.result!r}, replayed {result!r}"
            )
    return len(trace.entries)
