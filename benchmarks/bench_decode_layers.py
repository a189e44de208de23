"""What each server layer adds to a decode step, side by side on the same loop.

A decode step of ``--requests`` running requests: every request appends one sampled
token and allocates one slot. The same steps run through four layers, each on its own
pool built the same way, in interleaved rounds:

* ``core``: ``Request.append_output_token_ids`` + ``KVCacheManager.allocate_slots``
  (what the in-process scheduler backend pays);
* ``table``: the server's ``RequestTable`` (argument checks, metrics batching, tenant
  and copy bookkeeping) inside ``RequestTable.batched``;
* ``step``: the server's ``StepRunner`` on a serialized ``StepRequest`` as the
  scheduler's batching backends build it (``StepBuilder`` with coalescing and
  ``omit_request_state``: one AppendTokensBatch and one AllocateSlotsBatch), parsed,
  run and answered as bytes, without the transport;
* ``client``: ``step`` plus the client's side, timed too: the ``StepBuilder`` calls
  that build each step and a ``StepResults`` read of every allocation's handle (what
  a batching backend does around each message), still without the transport;
* ``link``: ``step`` behind the schedulers' remote-step mechanism (``StepLink``): each
  append and allocation recorded in its ``StepLog`` with the replica's answer (computed
  beforehand, untimed), the step sent to the runner (``kvservice.bench.local_step``)
  and every answer checked, still without the transport;
* ``step-single``: ``step`` with coalescing off (``StepBuilder(coalesce=False)``): a
  message operation per append and per allocation, so the runner's per-operation loop
  and converters run once per entry.

Prints microseconds per request per step (one append plus one allocation): the
median over rounds and the lowest and highest round (the run's own noise), and each
layer's cost as a ratio to the core's in the same round, median over rounds. Each
round runs the layers in another order (``kvservice.bench.measure``).

Run: ``python -m benchmarks.bench_decode_layers [--requests 256] [--steps 40]
[--rounds 5] [--layers core,step,...]`` (``core`` always runs: the ratios' base).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvservice.bench.local_step import local_send
from kvservice.bench.measure import layer_names, print_layers, time_layers
from kvservice.client import StepBuilder, StepResults
from kvservice.client.step_link import StepLink
from kvservice.core.request import Request
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, NewRequest
from kvservice.server.caller import ANONYMOUS
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.step import StepRunner

PROMPT_LEN = 100
ONE = AllocateArgs(num_new_tokens=1)


def pool(num_requests: int, steps: int) -> ServerConfig:
    # Room for every request's prompt and decodes, so no allocation meets a full pool.
    blocks = num_requests * ((PROMPT_LEN + steps) // 16 + 2) + 1
    return ServerConfig(num_blocks=blocks, block_size=16, max_model_len=PROMPT_LEN + steps + 16)


def prompt(i: int) -> list[int]:
    return list(range(i * 1000, i * 1000 + PROMPT_LEN))


def core_steps(num_requests: int, steps: int) -> Callable[[], None]:
    manager = build_manager(pool(num_requests, steps))
    requests = []
    for i in range(num_requests):
        request = Request(f"r{i}", prompt(i), manager.block_hasher)
        manager.allocate_slots(request, PROMPT_LEN)
        request.num_computed_tokens = PROMPT_LEN
        requests.append(request)

    def run() -> None:
        for token in range(steps):
            for request in requests:
                request.append_output_token_ids([token])
                manager.allocate_slots(request, 1)
                request.num_computed_tokens += 1

    return run


def _table(num_requests: int, steps: int) -> RequestTable:
    manager = build_manager(pool(num_requests, steps))
    table = RequestTable(manager, KVCacheMetrics(manager, "bench", "0"))
    for i in range(num_requests):
        table.add_request(NewRequest(f"r{i}", prompt(i)), "")
        table.allocate_slots(f"r{i}", AllocateArgs(num_new_tokens=PROMPT_LEN), "")
    return table


def table_steps(num_requests: int, steps: int) -> Callable[[], None]:
    table = _table(num_requests, steps)
    ids = [f"r{i}" for i in range(num_requests)]

    def run() -> None:
        for token in range(steps):
            with table.batched():
                for rid in ids:
                    table.append_tokens(rid, [token], "")
                    table.allocate_slots(rid, ONE, "")

    return run


def step_path(num_requests: int, steps: int, coalesce: bool = True) -> Callable[[], None]:
    runner = StepRunner(_table(num_requests, steps), max_ops=4 * num_requests)
    messages = []
    for token in range(steps):
        builder = StepBuilder(omit_request_state=True, coalesce=coalesce)
        for i in range(num_requests):
            builder.append_tokens(f"r{i}", [token])
        for i in range(num_requests):
            builder.allocate_slots(f"r{i}", 1)
        messages.append(builder.to_pb(token, stop_on_error=True).SerializeToString())

    def run() -> None:
        for raw in messages:
            response = pb.StepResponse()
            runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
            response.SerializeToString()

    return run


def client_path(num_requests: int, steps: int) -> Callable[[], None]:
    runner = StepRunner(_table(num_requests, steps), max_ops=4 * num_requests)
    ids = [f"r{i}" for i in range(num_requests)]

    def run() -> None:
        for token in range(steps):
            builder = StepBuilder(omit_request_state=True)
            for rid in ids:
                builder.append_tokens(rid, [token])
            handles = [builder.allocate_slots(rid, 1) for rid in ids]
            raw = builder.to_pb(token, stop_on_error=True).SerializeToString()
            response = pb.StepResponse()
            runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
            results = StepResults(pb.StepResponse.FromString(response.SerializeToString()))
            if results.errors:
                raise RuntimeError(f"step {token} failed: {results.errors}")
            for handle in handles:
                results[handle]

    return run


def link_path(num_requests: int, steps: int) -> Callable[[], None]:
    # The replica's answers: the same steps on a table built the same way.
    replica = _table(num_requests, steps)
    ids = [f"r{i}" for i in range(num_requests)]
    answers = []
    for token in range(steps):
        row = []
        for rid in ids:
            replica.append_tokens(rid, [token], "")
            groups = replica.allocate_slots(rid, ONE, "").new_block_ids
            row.append(None if groups is None else tuple(tuple(g) for g in groups))
        answers.append(row)
    runner = StepRunner(_table(num_requests, steps), max_ops=4 * num_requests)

    def run() -> None:
        link = StepLink(local_send(runner), "bench")
        for token in range(steps):
            log = link.log
            for rid in ids:
                log.append_tokens(rid, [token])
            for rid, answer in zip(ids, answers[token], strict=True):
                log.allocate(rid, 1, answer)
            link.flush()

    return run


def step_single_path(num_requests: int, steps: int) -> Callable[[], None]:
    """``step_path`` with one message operation per entry (no columnar runs)."""
    return step_path(num_requests, steps, coalesce=False)


LAYERS = {
    "core": core_steps,
    "table": table_steps,
    "step": step_path,
    "client": client_path,
    "link": link_path,
    "step-single": step_single_path,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    names = layer_names(parser, args.layers, list(LAYERS))
    # A fresh pool per layer and round (each run consumes its decode steps).
    samples = time_layers(
        lambda name: LAYERS[name](args.requests, args.steps),
        names,
        args.rounds,
        args.requests * args.steps,
    )
    print(
        f"decode steps of {args.requests} requests (one append + one allocation each), "
        f"{args.steps} steps, {args.rounds} rounds"
    )
    print_layers(samples, "us/request")


if __name__ == "__main__":
    main()
