"""Run traces: every ``Backend`` call of a run and its answer, as JSON lines.

``TracingBackend`` records while a scheduler runs; ``write_trace`` / ``read_trace``
store it (a header line, then one line per call); ``replay`` issues the same calls
against another backend and ``check_replay`` fails at the first answer that differs.
A trace replays without the scheduler, so it pins the request table's behaviour alone.

Version 2 added ``admit`` (a step's admissions in one call), version 3
``new_step_starts`` (a step boundary); an older trace holds only the other calls,
which replay as before (a pool never told of steps treats each allocation as a step
of its own), so it is still read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvservice.client.types import (
    AdmitOptions,
    BlockIds,
    ComputedBlocks,
    Retention,
    TokenRangeRetention,
)
from kvservice.scheduler.backend import AdmittedIds, Backend, ForwardingBackend

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


def _hit_to_json(hit: ComputedBlocks | None) -> dict[str, Any] | None:
    if hit is None:
        return None
    return {
        "block_ids": _ids_to_json(hit.block_ids),
        "num_computed_tokens": hit.num_computed_tokens,
        "shared_prefix_boundary": hit.shared_prefix_boundary,
    }


def _hit_from_json(value: Any) -> ComputedBlocks | None:
    if value is None:
        return None
    return ComputedBlocks(
        _ids_from_json(value["block_ids"]) or (),
        int(value["num_computed_tokens"]),
        int(value["shared_prefix_boundary"]),
    )


def _admitted_to_json(admitted: Sequence[AdmittedIds]) -> list[dict[str, Any]]:
    """``admit``'s answer."""
    return [
        {
            "request_id": item.request_id,
            "num_hit_tokens": item.num_hit_tokens,
            "num_new_tokens": item.num_new_tokens,
            "new_block_ids": _ids_to_json(item.new_block_ids),
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


class TracingBackend(ForwardingBackend):
    """A ``Backend`` that forwards every call to ``inner`` and records it."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.entries: list[TraceEntry] = []

    def _record(self, op: str, args: dict[str, Any], result: Any = None) -> None:
        self.entries.append(TraceEntry(op, args, result))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        super().add_request(request_id, prompt_token_ids, retention)
        args: dict[str, Any] = {
            "request_id": request_id,
            "prompt_token_ids": list(prompt_token_ids),
        }
        if retention is not None:
            args["retention"] = dataclasses.asdict(retention)
        self._record("add_request", args)

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self._record("new_step_starts", {})

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        hit = super().get_computed_blocks(request_id)
        self._record("get_computed_blocks", {"request_id": request_id}, _hit_to_json(hit))
        return hit

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
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
            backend.add_request(
                str(args["request_id"]),
                [int(t) for t in args["prompt_token_ids"]],
                _retention(args.get("retention")),
            )
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
            return None if new_block_ids is None else _ids_to_json(new_block_ids)
        case "admit":
            return _admitted_to_json(_admit(backend, args))
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
    return [result for _, _, result in _replayed(entries, backend)]


# Calls that decide a step; the scheduler's loop ends the step's decisions
# (``end_step``) before the appends and frees that follow its forward pass.
_DECISIONS = frozenset({"get_computed_blocks", "allocate_slots", "admit"})


def _replayed(
    entries: Iterable[TraceEntry], backend: Backend
) -> Iterator[tuple[int, TraceEntry, Any]]:
    """Each recorded call issued again, with its answer. A trace holds no ``end_step``:
    it comes back where the loop calls it, after a step's decisions and before the
    first call that is not one (a replicated backend sends the step there)."""
    deciding = False
    for index, entry in enumerate(entries):
        if entry.op in _DECISIONS:
            deciding = True
        elif deciding and not (entry.op == "free" and entry.args.get("preempt")):
            backend.end_step()
            deciding = False
        yield index, entry, _apply(backend, entry)


def _subject(entry: TraceEntry) -> Any:
    """The request(s) a call is about, for an error message."""
    return entry.args.get("request_id", entry.args.get("request_ids", ""))


def check_replay(trace: Trace, backend: Backend) -> int:
    """Replay ``trace`` against ``backend``, raising ``TraceMismatchError`` at the first
    answer that differs from the recording; the number of calls replayed."""
    for index, entry, result in _replayed(trace.entries, backend):
        if result != entry.result:
            raise TraceMismatchError(
                f"call {index} ({entry.op} {_subject(entry)!r}): recorded "
                f"{entry.result!r}, replayed {result!r}"
            )
    backend.flush()
    return len(trace.entries)


def _retention(fields: Any) -> Retention | None:
    """A request's retention as a trace stores it (``dataclasses.asdict``)."""
    if fields is None:
        return None
    return Retention(
        tuple(TokenRangeRetention(**r) for r in fields["token_ranges"]),
        fields["decode_priority"],
        fields["decode_duration_s"],
    )
