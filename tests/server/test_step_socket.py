"""``--step-socket``: StepStream on a Unix domain socket without gRPC. The same steps
answer as over gRPC; the stream goes through the same layers (tokens, sessions, the
drain, metrics, errors as statuses); the transport's own rules (a dropped connection
is a vanished client, frames are bounded, the hello comes first) hold; the socket file
is its user's only."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.client import AsyncKVClient, KVClient, PendingStep, SocketSession, StepBuilder
from kvservice.client.errors import (
    InvalidArgumentError,
    RequestNotFoundError,
    ResourceExhaustedError,
    ServiceUnavailableError,
    UnauthenticatedError,
)
from kvservice.client.step import OpHandle
from kvservice.protocol import step_socket as wire
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.binding import BindError
from kvservice.server.config import ServerConfig
from kvservice.server.settings import load_settings
from kvservice.server.tls import SecurityConfigError, check_step_socket
from tests.server.support import SMALL_POOL
from tests.server.test_tenants import write_tokens_file
from tests.servers import ThreadedServer, running_server, server_in_thread

TOKEN = "alpha-token-0123456789"
LABELS = {"model_name": "test-model", "engine": "0"}
WAIT_S = 30.0


def _config(tmp_path: Path, **changes: Any) -> ServerConfig:
    return dataclasses.replace(SMALL_POOL, step_socket=str(tmp_path / "steps.sock"), **changes)


Answers = list[object]


def _scheduler_steps(send: Callable[[StepBuilder], PendingStep]) -> Answers:
    """A scheduler's few steps (admissions, a refusal inside a step, decodes, a hit,
    frees) sent on ``send``; every operation's value, or its error's type and text."""
    first = StepBuilder()
    handles: list[list[OpHandle[Any]]] = [
        [
            first.add_request("a", list(range(40))),
            first.add_request("b", list(range(30))),
            first.allocate_slots("a", 40),
            first.allocate_slots("b", 30),
            first.append_tokens("missing", [1]),  # NOT_FOUND, as a result
        ]
    ]
    second = StepBuilder()
    handles.append(
        [
            second.append_tokens("a", [7]),
            second.allocate_slots("a", 1),
            second.add_request("c", list(range(40))),  # a's prefix: a hit
            second.get_computed_blocks("c"),
            second.allocate_slots("c", 40),
        ]
    )
    third = StepBuilder()
    handles.append([third.free("a"), third.free("b"), third.get_usage()])
    answers: Answers = []
    for builder, ops in zip([first, second, third], handles, strict=True):
        results = send(builder).result()
        for op in ops:
            error = results.error(op)
            answers.append(repr(results[op]) if error is None else (type(error), str(error)))
    return answers


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _metric(server: ThreadedServer, name: str, **labels: str) -> float:
    registry = server.server.metrics.registry
    value = server.call(lambda: registry.get_sample_value(name, {**LABELS, **labels}))
    return 0.0 if value is None else value


def _writers() -> list[threading.Thread]:
    """The step sockets' writing threads alive."""
    return [t for t in threading.enumerate() if t.name.startswith("kvservice-step-socket")]


@pytest.mark.parametrize("write_thread", [False, True])
def test_steps_answer_as_they_do_over_grpc(tmp_path: Path, write_thread: bool) -> None:
    config = _config(tmp_path)
    with server_in_thread(config) as server, KVClient(server.target) as client:
        with client.socket_session(config.step_socket, write_thread=write_thread) as steps:
            assert len(_writers()) == write_thread
            over_socket = _scheduler_steps(steps.send)
        assert not _writers()
        usage = client.get_usage()
        server.call(server.server.audit)
    with server_in_thread(config) as server, KVClient(server.target) as client:
        with client.session() as grpc_steps:
            over_grpc = _scheduler_steps(grpc_steps.send)
        assert client.get_usage() == usage
    assert over_socket == over_grpc
    assert len(over_socket) == 13
    assert over_socket[4][0] is RequestNotFoundError  # type: ignore[index]
    assert usage.num_requests == 1  # c


@pytest.mark.parametrize("write_thread", [False, True])
def test_steps_sent_ahead_are_answered_in_order(tmp_path: Path, write_thread: bool) -> None:
    config = _config(tmp_path)
    with server_in_thread(config) as server, KVClient(server.target) as client:
        with client.socket_session(config.step_socket, write_thread=write_thread) as steps:
            sent = []
            for i in range(20):
                builder = StepBuilder()
                builder.add_request(f"r{i}", [i] * 5)
                usage = builder.get_usage()
                sent.append((steps.send(builder), usage))
            requests = [pending.result()[usage].num_requests for pending, usage in sent]
        assert requests == list(range(1, 21))
        assert _metric(server, "kvservice_rpc_duration_seconds_count", method="StepStream") == 20
        assert _metric(server, "kvservice_step_socket_connections_total") == 1


@pytest.mark.parametrize("write_thread", [False, True])
def test_a_dropped_connection_ends_its_session(tmp_path: Path, write_thread: bool) -> None:
    """As a cancelled gRPC stream: the session ends at once, its requests freed."""
    config = _config(tmp_path)
    with (
        server_in_thread(config) as server,
        KVClient(server.target) as client,
        KVClient(server.target) as observer,
    ):
        lease = client.open_session(600)
        steps = client.socket_session(config.step_socket, write_thread=write_thread)
        builder = StepBuilder()
        builder.add_request("s", list(range(32)))
        allocation = builder.allocate_slots("s", 32)
        assert steps.step(builder)[allocation] is not None
        assert observer.get_usage().num_used_blocks == 2
        steps.cancel()
        assert not _writers()
        _wait_until(lambda: observer.get_usage().num_requests == 0, "the session's end")
        expired = _metric(server, "kvservice_session_expirations_total", reason="stream_broken")
        assert expired == 1
        assert observer.get_usage().num_used_blocks == 0
        lease.stop_renewing()
        server.call(server.server.audit)


def test_a_clean_close_keeps_its_session(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with server_in_thread(config) as server, KVClient(server.target) as client:
        lease = client.open_session(600)
        with client.socket_session(config.step_socket) as steps:
            builder = StepBuilder()
            builder.add_request("kept", list(range(8)))
            steps.step(builder)
        assert client.get_usage().num_requests == 1
        assert server.server.sessions.num_owned_requests == 1
        assert _metric(server, "kvservice_session_expirations_total", reason="stream_broken") == 0
        lease.stop_renewing()


def test_a_writer_blocked_on_a_server_that_stopped_reading_is_cancelled(
    tmp_path: Path,
) -> None:
    """A step larger than the socket's buffers, to a peer that never reads: the
    writing thread blocks in the write, and ``cancel`` still returns and ends it."""
    path = str(tmp_path / "deaf.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        steps = SocketSession(path, (), write_thread=True)
        peer, _ = listener.accept()
        with peer:
            builder = StepBuilder()
            builder.add_request("huge", [1] * 4_000_000)  # a 16 MB frame
            steps.send(builder)
            assert len(_writers()) == 1
            steps.cancel()
            assert not _writers()


def test_the_hello_carries_the_token(tmp_path: Path) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.toml", {"alpha": {"tokens": [TOKEN]}})
    config = _config(tmp_path, auth_tokens_file=tokens)
    with server_in_thread(config) as server:
        with KVClient(server.target, token=TOKEN, allow_insecure_token=True) as alpha:
            with alpha.socket_session(config.step_socket) as steps:
                builder = StepBuilder()
                builder.add_request("mine", list(range(8)))
                steps.step(builder)
            assert alpha.get_request("mine").num_tokens == 8  # alpha's own
        with KVClient(server.target) as anonymous:
            steps = anonymous.socket_session(config.step_socket)
            builder = StepBuilder()
            builder.add_request("theirs", list(range(8)))
            with pytest.raises(UnauthenticatedError, match="authorization"):
                steps.step(builder)
            steps.cancel()
        with KVClient(server.target, token=TOKEN, allow_insecure_token=True) as alpha:
            assert alpha.get_usage().num_requests == 1  # the refused step added nothing


def test_the_tenants_rate_holds_each_message_back(tmp_path: Path) -> None:
    """Its messages count against the rate, as a gRPC stream's: slowed, not ended."""
    tokens = write_tokens_file(
        tmp_path / "tokens.toml", {"alpha": {"tokens": [TOKEN], "rate_limit": 20.0, "burst": 1}}
    )
    config = _config(tmp_path, auth_tokens_file=tokens)
    with server_in_thread(config) as server:
        with KVClient(server.target, token=TOKEN, allow_insecure_token=True) as alpha:
            with alpha.socket_session(config.step_socket) as steps:
                for i in range(4):
                    builder = StepBuilder()
                    builder.add_request(f"r{i}", [1, 2, 3])
                    steps.step(builder)
            time.sleep(0.2)  # a unary call over the rate would be refused, not slowed
            assert alpha.get_usage().num_requests == 4
        delay = _metric(server, "kvservice_rate_limit_delay_seconds_total", tenant="alpha")
        assert delay > 0


def _raw(path: str, *frames: bytes) -> list[tuple[int, bytes]]:
    """Send ``frames`` on a fresh connection; every frame the server answers until it
    closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(path)
        for data in frames:
            sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    answers = []
    while received:
        length, kind = wire.HEADER.unpack_from(received)
        end = wire.HEADER.size + length
        answers.append((kind, received[wire.HEADER.size : end]))
        received = received[end:]
    return answers


def _status(answer: tuple[int, bytes]) -> pb.StepSocketStatus:
    kind, payload = answer
    assert kind == wire.STATUS
    return pb.StepSocketStatus.FromString(payload)


def _hello() -> bytes:
    return wire.frame(wire.HELLO, pb.StepSocketHello().SerializeToString())


def _add(request_id: str) -> bytes:
    step = StepBuilder()
    step.add_request(request_id, list(range(8)))
    return wire.frame(wire.MESSAGE, step.to_stream_pb(1).SerializeToString())


def test_frames_out_of_place_are_refused(tmp_path: Path) -> None:
    """Each ends the stream with a status naming the problem; none changes the pool."""
    config = _config(tmp_path, max_message_bytes=4096)
    path = config.step_socket
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with server_in_thread(config) as server, KVClient(server.target) as client:
        no_hello = _status(_raw(path, _add("x"))[0])
        assert no_hello.code == invalid
        assert "message frame where the hello was expected" in no_hello.details
        second_hello = _raw(path, _hello(), _hello())
        assert _status(second_hello[-1]).code == invalid
        assert "hello frame where a step" in _status(second_hello[-1]).details
        garbage = _raw(path, _hello(), wire.frame(wire.MESSAGE, b"\xff\xff\xff"))
        assert _status(garbage[-1]).code == invalid
        assert "malformed request message" in _status(garbage[-1]).details
        big = _raw(path, _hello(), wire.HEADER.pack(1 << 20, wire.MESSAGE))
        assert _status(big[-1]).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "max_message_bytes" in _status(big[-1]).details
        bad_hello = _raw(path, wire.frame(wire.HELLO, b"\xff\xff"))
        assert "malformed hello" in _status(bad_hello[-1]).details
        # A well-formed stream on a raw connection: the answer, then status OK.
        good = _raw(path, _hello(), _add("ok"), wire.frame(wire.END))
        assert [kind for kind, _ in good] == [wire.MESSAGE, wire.STATUS]
        assert _status(good[-1]).code == 0
        assert client.get_usage().num_requests == 1
        server.call(server.server.audit)


def test_the_socket_file_is_its_users_only(tmp_path: Path) -> None:
    config = _config(tmp_path)
    path = Path(config.step_socket)
    with server_in_thread(config):
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.exists()  # removed at stop
    path.write_text("keep me")
    with pytest.raises(BindError, match="exists and is not a socket"), server_in_thread(config):
        pass
    assert path.read_text() == "keep me"


def test_a_stream_left_at_shutdown_is_ended(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with server_in_thread(config) as server:
        client = KVClient(server.target)
        steps = client.socket_session(config.step_socket)
        builder = StepBuilder()
        builder.get_usage()
        steps.step(builder)
    with pytest.raises(ServiceUnavailableError):
        steps.step(builder)
    steps.cancel()
    client.close()
    with pytest.raises(ServiceUnavailableError, match="cannot connect to the step socket"):
        SocketSession(config.step_socket, ())


def test_a_refusal_inside_the_stream_comes_back_typed(tmp_path: Path) -> None:
    """The layers' refusals arrive as over gRPC: here the server's step limit."""
    config = _config(tmp_path, max_step_ops=2)
    with server_in_thread(config) as server, KVClient(server.target) as client:
        steps = client.socket_session(config.step_socket)
        builder = StepBuilder()
        for i in range(3):
            builder.add_request(f"r{i}", [1, 2, 3])
        with pytest.raises(InvalidArgumentError, match=r"max_step_ops|operations"):
            steps.step(builder)
        steps.cancel()
        assert client.get_usage().num_requests == 0


async def test_the_asyncio_client_streams_on_the_socket(tmp_path: Path) -> None:
    """``AsyncKVClient.socket_session``: AsyncSession's methods; steps sent ahead are
    answered in order, and a cancelled one ends the session it streamed under."""
    config = _config(tmp_path, max_message_bytes=64 * 1024)
    async with running_server(config) as server:
        async with AsyncKVClient(server.handle.target) as client:
            lease = await client.open_session(600)
            session = await client.socket_session(config.step_socket)
            sent = []
            for i in range(5):
                builder = StepBuilder()
                builder.add_request(f"r{i}", [i] * 5)
                usage = builder.get_usage()
                sent.append((await session.send(builder), usage))
            counts = [(await pending.result())[usage].num_requests for pending, usage in sent]
            assert counts == [1, 2, 3, 4, 5]
            session.cancel()
            deadline = time.monotonic() + WAIT_S
            while server.table.num_requests:
                assert time.monotonic() < deadline, "the session's requests were not freed"
                await asyncio.sleep(0.01)
            await lease.stop_renewing()
        async with AsyncKVClient(server.handle.target) as client:
            async with await client.socket_session(config.step_socket) as session:
                builder = StepBuilder()
                builder.add_request("kept", [1, 2, 3])
                await session.step(builder)
            assert (await client.get_usage()).num_requests == 1
            refused = await client.socket_session(config.step_socket)
            builder = StepBuilder()
            builder.add_request("kept", [1, 2, 3])  # ALREADY_EXISTS, as a result
            builder.append_tokens("kept", [-1])  # INVALID_ARGUMENT, as a result
            results = await refused.step(builder)
            assert not results.ok
            too_big = StepBuilder()
            too_big.add_request("big", list(range(20_000)))  # 80 KB of packed ids
            with pytest.raises(ResourceExhaustedError, match="max_message_bytes"):
                await refused.step(too_big)
            await refused.close()  # the step already raised the stream's error


def test_client_certificates_alone_refuse_a_step_socket() -> None:
    config = ServerConfig(step_socket="/run/steps.sock", tls_client_ca_file="/etc/ca.pem")
    with pytest.raises(SecurityConfigError, match="auth_tokens_file"):
        check_step_socket(config, has_tokens=False)
    check_step_socket(config, has_tokens=True)
    check_step_socket(dataclasses.replace(config, step_socket=""), has_tokens=False)


def test_flag_and_environment() -> None:
    assert load_settings({"step_socket": "/run/s.sock"}, {}).server.step_socket == "/run/s.sock"
    env = load_settings({}, {"KVSERVICE_STEP_SOCKET": "/run/t.sock"})
    assert env.server.step_socket == "/run/t.sock"
