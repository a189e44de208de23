"""What client and server agree on besides the proto: the call metadata keys, the
calls that change the pool and the packed token id encoding. Imports nothing of
kvservice, so the client can use it without reaching into the server's modules."""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

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
        "NewStepStarts",
        "FreeRetainedBlocks",
        "CacheBlocks",
        "PinPrefix",
        "UnpinPrefix",
    }
)
# Every call that changes the pool, the step stream included.
MUTATING_METHODS = MUTATING_UNARY_METHODS | {"StepStream"}


# -- packed token ids (AddRequestRequest.packed_prompt_token_ids) ----------------------

# The array type code of a 4-byte unsigned int on this platform ("I" nearly everywhere).
_U32 = next(code for code in "ILH" if array.array(code).itemsize == 4)
PACKED_TOKEN_ID_SIZE = 4


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4 bytes each, unsigned little-endian. Raises ``OverflowError``
    for an id outside [0, 2**32) and ``TypeError`` for one that is not an int."""
    packed = array.array(_U32, token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(packed: bytes) -> list[int]:
    """The ids ``pack_token_ids`` packed. Raises ``ValueError`` when the length is not
    a multiple of ``PACKED_TOKEN_ID_SIZE``."""
    return unpack_token_id_array(packed).tolist()


def unpack_token_id_array(packed: bytes) -> array.array[int]:
    """The ids ``pack_token_ids`` packed, left packed: an array of 4-byte unsigned ints
    in this machine's byte order (no Python int per id). Raises ``ValueError`` when the
    length is not a multiple of ``PACKED_TOKEN_ID_SIZE``."""
    values = array.array(_U32)
    values.frombytes(packed)
    if sys.byteorder != "little":
        values.byteswap()
    return values
