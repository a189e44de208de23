"""``--unix-socket``: the server also listens on a Unix domain socket, for an engine on
the same node (target ``unix:PATH``), beside its TCP port; a socket file a previous
server left is replaced, any other file at the path refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvservice.client import KVClient
from kvservice.server.binding import BindError
from kvservice.server.settings import load_settings
from tests.server.support import SMALL_POOL
from tests.servers import server_in_thread


def test_the_same_server_answers_on_its_socket_and_its_port(tmp_path: Path) -> None:
    path = tmp_path / "kvservice.sock"
    config = dataclasses.replace(SMALL_POOL, unix_socket=str(path))
    with (
        server_in_thread(config) as server,
        KVClient(f"unix:{path}") as local,
        KVClient(server.target) as remote,
    ):
        local.add_request("a", list(range(20)))
        assert local.allocate_slots("a", 20) is not None
        assert remote.get_request("a").num_tokens == 20  # one table behind both
        local.free("a")
    # A second server replaces the socket file the first left.
    with server_in_thread(config), KVClient(f"unix:{path}") as again:
        assert again.get_usage().num_requests == 0


def test_a_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    config = dataclasses.replace(SMALL_POOL, unix_socket=str(path))
    with pytest.raises(BindError, match="exists and is not a socket"), server_in_thread(config):
        pass
    assert path.read_text() == "keep me"


def test_flag_and_environment() -> None:
    assert load_settings({"unix_socket": "/run/kv.sock"}, {}).server.unix_socket == "/run/kv.sock"
    env = load_settings({}, {"KVSERVICE_UNIX_SOCKET": "/run/a.sock"})
    assert env.server.unix_socket == "/run/a.sock"
