"""A remote step without its transport: a ``StepLink``'s steps run on a ``StepRunner``
in this process, as bytes both ways (the client's and the server's serialization), so
that the layers benchmarks measure what the link itself costs."""

from __future__ import annotations

from kvservice.client.step import StepBuilder, StepResults
from kvservice.client.step_link import Send
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.caller import ANONYMOUS
from kvservice.server.step import StepRunner


class _Answered:
    """A sent step whose answer is in already (``step_link.SentStep``)."""

    __slots__ = ("_results",)

    def __init__(self, results: StepResults) -> None:
        self._results = results

    def result(self) -> StepResults:
        return self._results


def local_send(runner: StepRunner) -> Send:
    """``StepLink``'s ``send``: each step serialized, run whole by ``runner`` for the
    anonymous caller, and its answer serialized and parsed back."""

    def send(builder: StepBuilder) -> _Answered:
        raw = builder.to_pb(0, stop_on_error=True).SerializeToString()
        response = pb.StepResponse()
        runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
        return _Answered(StepResults(pb.StepResponse.FromString(response.SerializeToString())))

    return send
