"""What client and server agree on besides the proto: the call metadata keys and the
calls that change the pool. Imports nothing, so the client can use it without
reaching into the server's modules."""

from __future__ import annotations

# Metadata keys (gRPC metadata keys are lower case).
CLIENT_ID_KEY = "x-client-id"  # names the scheduler in logs and metrics
CALL_ID_KEY = "x-request-id"  # one call's id in the logs (generated when absent)
AUTHORIZATION_KEY = "authorization"  # "Bearer <token>" with a tokens file
SESSION_KEY = "x-kvservice-session"  # the session a call runs under
OPERATION_ID_KEY = "x-kvservice-operation-id"  # makes a retried mutating call apply once
RETRY_AFTER_KEY = "x-kvservice-retry-after-ms"  # trailer of a rate-limited call

# The unary calls that change the pool (GetComputedBlocks remembers the hit and
# counts prefix cache stats): the ones an operation id makes idempotent.
MUTATING_UNARY_METHODS = frozenset(
    {
        "AddRequest",
        "AppendTokens",
        "GetComputedBlocks",
        "AllocateSlots",
        "Admit",
        "FreeRequest",
        "ResetPrefixCache",
        "Step",
    }
)
# Every call that changes the pool, the step stream included.
MUTATING_METHODS = MUTATING_UNARY_METHODS | {"StepStream"}
