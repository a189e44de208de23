"""HTTP ``/health`` and ``/ready`` beside ``/metrics``, as vLLM and Triton serve them,
for load balancers and probes that speak HTTP rather than grpc.health.v1.

Both are answered on the metrics endpoint's threads, never by the server's loop, yet
both ask the loop: ``/health`` is 200 when the loop runs a callback within
``timeout_s`` (a process whose loop is stuck is not healthy, however well its HTTP
thread answers), ``/ready`` is 200 when it is also taking calls (started, not
shutting down). Otherwise 503 with the reason as the body.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

# How long a probe waits for the loop: far above any one call's time, well under the
# chart's 2 s probe timeout.
LOOP_TIMEOUT_S = 1.0

WsgiApp = Callable[[dict[str, Any], Any], Iterable[bytes]]


class LoopProbe:
    """What ``/health`` and ``/ready`` answer, asked from another thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        taking_calls: Callable[[], bool],
        timeout_s: float = LOOP_TIMEOUT_S,
    ) -> None:
        self._loop = loop
        self._taking_calls = taking_calls
        self._timeout_s = timeout_s

    def loop_responds(self) -> bool:
        """Whether the loop ran a callback within the timeout (call from another
        thread than the loop's)."""
        ran = threading.Event()
        try:
            self._loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed
            return False
        return ran.wait(self._timeout_s)

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if not self.loop_responds():
            return f"the event loop did not respond within {self._timeout_s:g} s"
        return None

    def readiness(self) -> str | None:
        """None when ready for calls, else why not."""
        if not self._taking_calls():
            return "not taking calls (starting or shutting down)"
        return self.health()


def with_probes(app: WsgiApp, probe: LoopProbe) -> WsgiApp:
    """``app`` (the metrics) with ``/health`` and ``/ready`` in front of it."""
    checks = {"/health": probe.health, "/ready": probe.readiness}

    def serve(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return app(environ, start_response)
        problem = check()
        status = "200 OK" if problem is None else "503 Service Unavailable"
        body = f"{problem or 'ok'}\n".encode()
        headers = [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
        ]
        start_response(status, headers)
        return [body]

    return serve
