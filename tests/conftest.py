"""Set before anything imports grpc, as ``kvservice serve`` does: gRPC without fork
handlers, so the tests' servers may audit large pools in a forked snapshot
(``kvservice.server.forking``).

Then the fixtures of a server in this process (``tests.servers.running_server``):
``server``, and on it ``channel``, ``stub`` (the generated stub) and ``client`` (an
``AsyncKVClient``). Their config is the ``server_config`` fixture: the small pool,
unless a module (or class) defines a ``server_config`` fixture of its own, or a test
parametrizes it (``@pytest.mark.parametrize("server_config", [CONFIG])``). They import
the server when first used, not here: a test that needs none (the build's, the
deployment's) runs whatever state the compiled core is in.
"""

from __future__ import annotations

from kvservice.server.forking import disable_grpc_fork_handlers, grpc_fork_handlers_off

disable_grpc_fork_handlers()
assert grpc_fork_handlers_off(), (
    "GRPC_ENABLE_FORK_SUPPORT must be unset or 0 for the tests, and grpc not imported "
    "before tests/conftest.py"
)

# Only now may grpc be imported (the annotations below are not evaluated).
from collections.abc import AsyncIterator  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    import grpc

    from kvservice.client import AsyncKVClient
    from kvservice.protocol.gen.kv_cache_service_pb2_grpc import KVCacheServiceStub
    from kvservice.server.app import KVCacheServer
    from kvservice.server.config import ServerConfig


@pytest.fixture
def server_config() -> ServerConfig:
    """The config of the ``server`` fixture (override it to change the server)."""
    from tests.server.support import SMALL_POOL  # noqa: PLC0415

    return SMALL_POOL


@pytest.fixture
async def server(server_config: ServerConfig) -> AsyncIterator[KVCacheServer]:
    """A started server on a free loopback port, on the test's loop."""
    from tests.servers import running_server  # noqa: PLC0415

    async with running_server(server_config) as server:
        yield server


@pytest.fixture
async def channel(server: KVCacheServer) -> AsyncIterator[grpc.aio.Channel]:
    import grpc  # noqa: PLC0415

    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> KVCacheServiceStub:
    from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc  # noqa: PLC0415

    return pb_grpc.KVCacheServiceStub(channel)


@pytest.fixture
async def client(server: KVCacheServer) -> AsyncIterator[AsyncKVClient]:
    from kvservice.client import AsyncKVClient  # noqa: PLC0415

    async with AsyncKVClient(server.handle.target, client_id="test-scheduler") as client:
        yield client
