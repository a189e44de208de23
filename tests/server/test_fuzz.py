"""Fuzzing a live server: random and malformed RPC sequences through the raw generated
stub (values the typed client would refuse to send), mixed Step batches, and garbage
or truncated protobuf bytes on the raw channel.

Every answer must be OK or a status the RPC documents (never UNKNOWN or INTERNAL),
a refused call must leave the request table's whole state as it was, and after every
sequence the pool passes its audit and, once every request is finished, is whole.
One server per module: each example ends by finishing its requests, so the next
starts from an empty pool (with whatever the prefix cache kept, as in production).
"""

from __future__ import annotations

import contextlib
import dataclasses
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice.protocol import OPERATION_ID_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from tests.server.fuzz_support import (
    ALLOWED_CODES,
    BATCH_ENTRY_CODES,
    CALL_TIMEOUT_S,
    ID_POOL,
    MESSAGES,
    READ_ONLY,
    STEP_OP_RPC,
    UNARY_METHODS,
    Code,
    Tally,
    code_of_number,
    finish_everything,
    fuzz_settings,
    method_path,
    response_type,
    step_ops,
    table_state,
    wire_bytes,
)
from tests.server.support import SMALL_POOL
from tests.servers import ThreadedServer, server_in_thread

# Both twins of the differential test hash with the same seed, so their prefix caches
# hold the same keys.
FUZZ_POOL = dataclasses.replace(SMALL_POOL, none_hash_seed="fuzz")
TALLY = Tally()


@dataclass
class Live:
    """A server running on its own thread and a blocking channel to it."""

    server: ThreadedServer
    channel: grpc.Channel
    stub: pb_grpc.KVCacheServiceStub
    # Sent with every call: the session a sequence runs under, if any.
    metadata: tuple[tuple[str, str], ...] = ()
    # Sessions opened so far, for KeepAlive and CloseSession to name.
    sessions: list[str] = dataclasses.field(default_factory=list)

    def state(self) -> tuple[Any, ...]:
        return self.server.call(lambda: table_state(self.server.server.table))

    def audit(self) -> None:
        """The in-process audit and the Audit RPC."""
        self.server.call(self.server.server.audit)
        report = self.stub.Audit(pb.AuditRequest(), timeout=CALL_TIMEOUT_S)
        assert report.ok and not report.violations, report


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with live_server() as live:
        yield live
    # Shown with `pytest -s`: the numbers the closing note asks for.
    print(TALLY.line("fuzz"))


@contextlib.contextmanager
def live_server() -> Iterator[Live]:
    with server_in_thread(FUZZ_POOL) as server, grpc.insecure_channel(server.target) as channel:
        yield Live(server, channel, pb_grpc.KVCacheServiceStub(channel))


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[Live, Live]]:
    """Two fresh, identical servers for the differential test: the first gets Steps,
    the second the same operations one by one, so their histories stay equal."""
    with live_server() as stepped, live_server() as unary:
        yield stepped, unary


def call(live: Live, name: str, message: Any, operation_id: str | None = None) -> tuple[Code, Any]:
    """(status, response or details) of one unary call through the generated stub,
    under ``live``'s session and with ``operation_id`` when given."""
    metadata = live.metadata
    if operation_id is not None:
        metadata = (*metadata, (OPERATION_ID_KEY, operation_id))
    try:
        response = getattr(live.stub, name)(message, metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        TALLY.add(err.code())
        return err.code(), err.details()
    TALLY.add(Code.OK)
    return Code.OK, response


def checked_call(
    live: Live, name: str, message: Any, operation_id: str | None = None
) -> tuple[Code, Any]:
    """One call, answered with a documented status; a refusal, a NO_SPACE and any
    read-only call leave the request table exactly as it was (a retry answered from the
    operation id's memory included)."""
    before = live.state()
    code, answer = call(live, name, message, operation_id)
    allowed = ALLOWED_CODES[name]
    if live.metadata:  # under a session any call may learn that it ended or was fenced
        allowed |= SESSION_CODES
    if operation_id is not None:  # an id reused for another call, or over-long
        allowed |= {Code.INVALID_ARGUMENT}
    assert code in allowed, f"{name}({message}) answered {code}: {answer}"
    if name == "OpenSession" and code is Code.OK:
        live.sessions.append(answer.session_id)
    if code is not Code.OK:
        assert answer, f"{name} refused with {code} and no message"
    no_space = (
        code is Code.OK
        and name == "AllocateSlots"
        and answer.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE
    )
    if code is not Code.OK or no_space or name in READ_ONLY:
        assert live.state() == before, f"{name}({message}) answered {code} but changed state"
    if name == "Step" and code is Code.OK:
        check_step_results(message, answer, before, live.state())
    return code, answer


def check_step_results(
    step: pb.StepRequest, response: pb.StepResponse, before: Any, after: Any
) -> None:
    """One result per operation, each OK or its unary RPC's status; CANCELLED only
    after a failure under stop_on_error; a step whose every operation failed changed
    nothing."""
    assert response.step_id == step.step_id
    assert len(response.results) == len(step.ops)
    failed = False
    for op, result in zip(step.ops, response.results, strict=True):
        kind = op.WhichOneof("op")
        if result.WhichOneof("result") != "error":
            assert result.WhichOneof("result") == kind
            assert kind is not None
            failed |= batch_entries_failed(kind, getattr(result, kind))
            continue
        code = code_of_number(result.error.code)
        assert result.error.message
        if code is Code.CANCELLED:
            assert step.stop_on_error and failed, result
        elif kind is None:
            assert code is Code.INVALID_ARGUMENT, result
        else:
            assert code in ALLOWED_CODES[STEP_OP_RPC[kind]], f"{op} answered {result}"
        failed = True
    if step.ops and all(r.WhichOneof("result") == "error" for r in response.results):
        assert after == before, f"every operation of {step} failed but the state changed"


def batch_entries_failed(kind: str, answer: Any) -> bool:
    """For a columnar operation's answer: each refused entry carries a status its
    single operation documents; whether any entry was refused (which, under
    stop_on_error, cancels the rest of the step)."""
    entry_codes = BATCH_ENTRY_CODES.get(STEP_OP_RPC[kind])
    if entry_codes is None:
        return False
    for error in answer.errors:
        assert error.message
        assert code_of_number(error.code) in entry_codes, f"{kind} entry {error}"
    return len(answer.errors) > 0


def admit(live: Live, request_id: str) -> None:
    """The scheduler's admission, passing back exactly the hit it was told: reaches
    the running and preempted states that random arguments rarely hit."""
    code, hit = checked_call(
        live, "GetComputedBlocks", pb.GetComputedBlocksRequest(request_id=request_id)
    )
    if code is not Code.OK:
        return
    code, found = checked_call(live, "GetRequest", pb.GetRequestRequest(request_id=request_id))
    if code is Code.OK:
        message = pb.AllocateSlotsRequest(
            request_id=request_id,
            num_new_tokens=found.request.num_tokens - hit.num_computed_tokens,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_block_ids=hit.block_ids,
        )
        checked_call(live, "AllocateSlots", message)


SESSION_CODES = frozenset({Code.NOT_FOUND, Code.FAILED_PRECONDITION})
# Mostly none; else a few ids reused across calls (a retry, or an id clash), or an
# arbitrary, possibly over-long one (metadata values must be printable ASCII).
operation_ids = st.one_of(
    st.none(),
    st.none(),
    st.sampled_from(("op-1", "op-2", "op-3")),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.", max_size=200),
)
RPC_NAMES = sorted(MESSAGES)
actions = st.one_of(
    st.tuples(st.sampled_from(RPC_NAMES), st.just(None)),
    st.tuples(st.just("admit"), st.sampled_from(ID_POOL)),
)


def draw_message(live: Live, data: st.DataObject, name: str) -> Any:
    message = data.draw(MESSAGES[name], label=name)
    if name in ("KeepAlive", "CloseSession"):
        # Often name a session that exists (or existed), not only random ids. Drawn
        # the same way whatever sessions exist: hypothesis replays draws, and the
        # server's sessions are state it does not control.
        known = data.draw(st.booleans(), label="known session")
        pick = data.draw(st.integers(0, 1000), label="which session")
        if known and live.sessions:
            message.session_id = live.sessions[pick % len(live.sessions)]
    return message


@contextlib.contextmanager
def maybe_in_session(live: Live, in_session: bool) -> Iterator[None]:
    """Run the block's calls under a fresh session (when ``in_session``), so
    ownership follows every request the sequence adds."""
    if not in_session:
        yield
        return
    # The current epoch: earlier examples may have opened sessions with any epoch.
    config = live.stub.GetCacheConfig(pb.GetCacheConfigRequest(), timeout=CALL_TIMEOUT_S)
    opened = live.stub.OpenSession(
        pb.OpenSessionRequest(ttl_seconds=600, epoch=config.scheduler_epoch),
        timeout=CALL_TIMEOUT_S,
    )
    live.metadata = (("x-kvservice-session", opened.session_id),)
    try:
        yield
    finally:
        live.metadata = ()


@fuzz_settings(40)
@given(
    data=st.data(),
    plan=st.lists(actions, min_size=1, max_size=25),
    in_session=st.booleans(),
)
def test_random_rpc_sequences(
    live: Live, data: st.DataObject, plan: list[tuple[str, Any]], in_session: bool
) -> None:
    """Random sequences of every RPC with random, malformed and out-of-range
    arguments (unknown and empty ids, negative and int64-edge counts, wrong states,
    batches mixing valid and invalid operations, sessions and leases of every kind,
    reused and over-long operation ids), with or without a session: documented
    statuses only, refusals change nothing, and the pool stays consistent and ends
    whole."""
    with maybe_in_session(live, in_session):
        for name, arg in plan:
            if name == "admit":
                admit(live, arg)
            else:
                message = draw_message(live, data, name)
                operation_id = data.draw(operation_ids, label="operation id")
                checked_call(live, name, message, operation_id)
            live.audit()
    finish_everything(live.server, live.stub)


@fuzz_settings(40)
@given(data=st.data(), name=st.sampled_from(UNARY_METHODS))
def test_malformed_bytes_on_every_unary_method(live: Live, data: st.DataObject, name: str) -> None:
    """Garbage, truncated, corrupted and over-long request bytes: INVALID_ARGUMENT when
    they do not parse (never UNKNOWN or INTERNAL), a refusal changes nothing, and an
    OK answer is a well-formed response."""
    payload = data.draw(wire_bytes(name), label="payload")
    raw = live.channel.unary_unary(method_path(name))
    before = live.state()
    try:
        answer = raw(payload, timeout=CALL_TIMEOUT_S)
        code = Code.OK
    except grpc.RpcError as err:
        code, answer = err.code(), err.details()
    TALLY.add(code)
    assert code in ALLOWED_CODES[name] | {Code.INVALID_ARGUMENT}, f"{name}: {code} {answer}"
    if code is Code.OK:
        response_type(name).FromString(answer)
    else:
        assert live.state() == before
    live.audit()
    finish_everything(live.server, live.stub)


def _parses(payload: bytes) -> bool:
    try:
        pb.StepStreamRequest.FromString(payload)
    except Exception:
        return False
    return True


@fuzz_settings(25)
@given(chunks=st.lists(wire_bytes("StepStream"), min_size=1, max_size=5))
def test_malformed_bytes_on_the_step_stream(live: Live, chunks: list[bytes]) -> None:
    """A stream of messages some of which do not parse: each message before the first
    bad one is answered, then the stream ends INVALID_ARGUMENT (OK when all parse)."""
    raw = live.channel.stream_stream(method_path("StepStream"))
    answers = []
    try:
        for answer in raw(iter(chunks), timeout=CALL_TIMEOUT_S):
            answers.append(pb.StepStreamResponse.FromString(answer))
        code = Code.OK
    except grpc.RpcError as err:
        code = err.code()
    TALLY.add(code)
    parsed = [_parses(c) for c in chunks]
    expected = parsed.index(False) if False in parsed else len(chunks)
    assert code is (Code.OK if all(parsed) else Code.INVALID_ARGUMENT)
    assert len(answers) == expected
    live.audit()
    finish_everything(live.server, live.stub)


@fuzz_settings(15)
@given(payload=wire_bytes("SubscribeEvents"))
def test_malformed_bytes_on_subscribe_events(live: Live, payload: bytes) -> None:
    """Without --kv-events every subscription ends FAILED_PRECONDITION; bytes that do
    not parse end INVALID_ARGUMENT."""
    raw = live.channel.unary_stream(method_path("SubscribeEvents"))
    with pytest.raises(grpc.RpcError) as info:
        list(raw(payload, timeout=CALL_TIMEOUT_S))
    code = info.value.code()
    TALLY.add(code)
    assert code in {Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT}, info.value.details()


def unary_twin_of(live: Live, step: pb.StepRequest) -> list[tuple[Code, Any]]:
    """The step's operations as unary calls, in order (stopping after the first
    failure under stop_on_error)."""
    answers: list[tuple[Code, Any]] = []
    for op in step.ops:
        kind = op.WhichOneof("op")
        if kind is None:
            answers.append((Code.INVALID_ARGUMENT, None))
        else:
            answers.append(call(live, STEP_OP_RPC[kind], getattr(op, kind)))
        if step.stop_on_error and answers[-1][0] is not Code.OK:
            break
    return answers


@fuzz_settings(30)
@given(
    ops=st.lists(step_ops, min_size=1, max_size=12),
    stop_on_error=st.booleans(),
)
def test_step_answers_as_unary_calls(
    twins: tuple[Live, Live], ops: list[pb.StepOperation], stop_on_error: bool
) -> None:
    """A Step mixing valid and invalid operations answers each one exactly as the
    same unary call would (status and payload) and leaves the same state behind, so
    a refused operation in a step changes nothing, as a refused call does."""
    live, twin = twins
    step = pb.StepRequest(step_id=7, ops=ops, stop_on_error=stop_on_error)
    code, response = checked_call(live, "Step", step)
    assert code is Code.OK
    unary = unary_twin_of(twin, step)
    for index, (result, (unary_code, unary_answer)) in enumerate(
        zip(response.results, unary, strict=False)
    ):
        kind = result.WhichOneof("result")
        if kind == "error":
            assert code_of_number(result.error.code) is unary_code, (index, result, unary_answer)
        else:
            assert unary_code is Code.OK, (index, result, unary_answer)
            assert getattr(result, kind) == unary_answer, index
    for result in response.results[len(unary) :]:
        assert code_of_number(result.error.code) is Code.CANCELLED
    assert live.state() == twin.state()
    live.audit()
    twin.audit()
    finish_everything(live.server, live.stub)
    finish_everything(twin.server, twin.stub)


def test_server_alive_after_fuzzing(live: Live) -> None:
    """After everything above, the same server still serves a full request lifecycle."""
    rid = "after-fuzz"
    checked_call(
        live, "AddRequest", pb.AddRequestRequest(request_id=rid, prompt_token_ids=[1] * 40)
    )
    admit(live, rid)
    _, state = checked_call(live, "GetRequest", pb.GetRequestRequest(request_id=rid))
    assert state.request.status == pb.REQUEST_STATUS_RUNNING
    finish_everything(live.server, live.stub)


def test_refusal_naming_a_huge_id_keeps_its_status(live: Live) -> None:
    """Found by the fuzzer: a refusal echoing a 2,000-character non-ASCII request id
    made a status trailer over grpc's 8 KiB limit, so the client saw
    RESOURCE_EXHAUSTED instead of NOT_FOUND. The message is now cut, saying so."""
    huge = "\U0001f600ª\x0b" * 700
    code, details = call(live, "GetRequest", pb.GetRequestRequest(request_id=huge))
    assert code is Code.NOT_FOUND, details
    assert "cut from" in details
    step = pb.StepRequest(ops=[pb.StepOperation(get_request=pb.GetRequestRequest(request_id=huge))])
    code, response = call(live, "Step", step)
    assert code is Code.OK
    assert code_of_number(response.results[0].error.code) is Code.NOT_FOUND
