"""The step socket's framing (``kvservice serve --step-socket PATH``): StepStream's
messages on a Unix domain socket, without gRPC's HTTP/2 layers.

A frame is a header, ``HEADER`` (the payload's length, 4 bytes big-endian, then its
kind, 1 byte), and the payload. A connection carries one StepStream:

* client: one ``HELLO`` (a ``StepSocketHello``: the call metadata a gRPC StepStream
  would carry), then ``MESSAGE`` frames (``StepStreamRequest``) and one empty ``END``
  (the half-close: without it, a closed connection is a client that vanished, and the
  server ends the session it streamed under, as gRPC's cancellation does);
* server: a ``MESSAGE`` (``StepStreamResponse``) per request, in order, then one
  ``STATUS`` (``StepSocketStatus``: a gRPC status code and message), then it closes.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">IB")
HELLO = 1
MESSAGE = 2
END = 3
STATUS = 4
KIND_NAMES = {HELLO: "hello", MESSAGE: "message", END: "end", STATUS: "status"}


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame of ``kind`` around ``payload``."""
    return HEADER.pack(len(payload), kind) + payload
