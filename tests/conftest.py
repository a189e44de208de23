"""Set before anything imports grpc, as ``kvservice serve`` does: gRPC without fork
handlers, so the tests' servers may audit large pools in a forked snapshot
(``kvservice.server.forking``)."""

from kvservice.server.forking import disable_grpc_fork_handlers, grpc_fork_handlers_off

disable_grpc_fork_handlers()
assert grpc_fork_handlers_off(), (
    "GRPC_ENABLE_FORK_SUPPORT must be unset or 0 for the tests, and grpc not imported "
    "before tests/conftest.py"
)
