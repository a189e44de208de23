"""What each server layer adds to admitting and finishing requests, side by side.

The admission counterpart of ``bench_decode_layers``: a step admits ``--requests`` new
requests (add, prefix lookup, allocation of the prompt) and finishes as many admitted
the step before, as a scheduler's churn does. Prompts are ``--prompt-len`` tokens; each
begins with a ``--shared``-token prefix that all share (every request but the first hits it),
the rest its own. The requests come with their block hashes (client_hashed, as vLLM's
scheduler sends them on a server that trusts them), computed beforehand, untimed. The
same steps run through three layers, each on its own pool, in interleaved rounds:

* ``core``: ``Request`` (client_hashed, hashes given), ``get_computed_blocks``,
  ``allocate_slots`` and ``free`` on the ``KVCacheManager``;
* ``table``: the server's ``RequestTable`` inside ``RequestTable.batched``, each request
  read by the server's converter from the AddRequest that carries it (packed prompt,
  hashes), its hit attached to its allocation as a client sends it. As in ``core``,
  the loop around the calls is this script's (interpreted), where ``step``'s is the
  compiled runner's;
* ``step``: the server's ``StepRunner`` on a serialized ``StepRequest`` as the
  scheduler's batching backends build it (one AddRequestBatch with packed prompts and
  hashes, one LookupAllocateBatch, one FreeBatch), parsed, run and answered as bytes,
  without the transport;
* ``link``: ``step`` behind the schedulers' remote-step mechanism (``StepLink``): each
  add, lookup, allocation and free recorded in its ``StepLog`` with the replica's answer
  (the lookups' hits and the allocations' blocks, computed beforehand, untimed), the
  step sent to the runner (``kvservice.bench.local_step``) and every answer checked,
  still without the transport.

Prints microseconds per admitted request (its add, lookup, allocation and later free):
the median over rounds, the lowest and highest round, and each layer's cost as a ratio
to the core's in the same round, median over rounds.

The defaults are ``bench_vllm_scheduler``'s churn prompts on average (a 0, 256 or
512-token system prompt, then 64-511 tokens of its own).

Run: ``python -m benchmarks.bench_admission_layers [--requests 16] [--steps 40]
[--prompt-len 544] [--shared 256] [--rounds 5] [--layers core,table,step,link]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvservice.bench.local_step import local_send
from kvservice.bench.measure import layer_names, print_layers, time_layers
from kvservice.client import BlockIds, ComputedBlocks, FreeMode, RunHandle, StepBuilder, StepResults
from kvservice.client.step_link import StepLink
from kvservice.core.request import Request
from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs
from kvservice.request_table.types import FreeMode as TableFreeMode
from kvservice.server import converters
from kvservice.server.caller import ANONYMOUS
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.step import StepRunner

BLOCK = 16
FINISH = TableFreeMode.FINISH
TENANT = ANONYMOUS.tenant


@dataclass(frozen=True)
class Admission:
    """One new request: its id, prompt, block hashes and the tokens its lookup hits."""

    request_id: str
    prompt: list[int]
    hashes: list[bytes]
    num_hit: int


@dataclass(frozen=True)
class Workload:
    """Each step's admissions, and the pool every layer builds for them."""

    steps: list[list[Admission]]
    config: ServerConfig


def pool(num_requests: int, prompt_len: int) -> ServerConfig:
    # Room for two steps' requests (those admitted and those finishing) twice over;
    # freed blocks stay cached, so later steps evict the oldest.
    blocks = 4 * num_requests * (prompt_len // BLOCK + 1) + 1
    return ServerConfig(num_blocks=blocks, block_size=BLOCK, max_model_len=prompt_len + BLOCK)


def workload(num_requests: int, steps: int, prompt_len: int, shared: int) -> Workload:
    config = pool(num_requests, prompt_len)
    hasher = build_manager(config).block_hasher
    prefix = list(range(shared))
    rows = []
    for step in range(steps):
        row = []
        for i in range(num_requests):
            first = 1000 + (step * num_requests + i) * prompt_len
            prompt = prefix + list(range(first, first + prompt_len - shared))
            hashes = [bytes(h) for h in Request("h", prompt, hasher).block_hashes]
            # Every request but the first finds the shared prefix's whole blocks cached.
            num_hit = shared // BLOCK * BLOCK if step or i else 0
            row.append(Admission(f"s{step}r{i}", prompt, hashes, num_hit))
        rows.append(row)
    return Workload(rows, config)


def _refused(what: str) -> RuntimeError:
    return RuntimeError(f"{what}: the pool is sized so that every admission fits")


def core_path(load: Workload) -> Callable[[], None]:
    manager = build_manager(load.config)

    def run() -> None:
        finishing: list[Request] = []
        for row in load.steps:
            admitted = []
            for new in row:
                request = Request(new.request_id, new.prompt, client_hashed=True)
                request.block_hashes.extend(new.hashes)
                hit, num_hit, _ = manager.get_computed_blocks(request)
                num_new = len(new.prompt) - num_hit
                if manager.allocate_slots(request, num_new, num_hit, hit) is None:
                    raise _refused(new.request_id)
                admitted.append(request)
            for request in finishing:
                manager.free(request)
            finishing = admitted
        for request in finishing:
            manager.free(request)

    return run


def _table(load: Workload) -> RequestTable:
    manager = build_manager(load.config)
    # The caller's hashes trusted, as a server started with --trust-client-block-hashes.
    return RequestTable(
        manager, KVCacheMetrics(manager, "bench", "0"), trusted_hash_tenants={TENANT}
    )


def table_path(load: Workload) -> Callable[[], None]:
    table = _table(load)
    # Each request as a single AddRequest carries it; the server's converter reads it.
    messages = [
        [
            pb.AddRequestRequest(
                request_id=new.request_id,
                packed_prompt_token_ids=pack_token_ids(new.prompt),
                block_hashes=new.hashes,
                client_hashed=True,
            )
            for new in row
        ]
        for row in load.steps
    ]

    def run() -> None:
        finishing: list[str] = []
        for row, row_messages in zip(load.steps, messages, strict=True):
            with table.batched():
                for new, msg in zip(row, row_messages, strict=True):
                    rid = new.request_id
                    table.check_request_size(rid, 0, TENANT)
                    table.add_request(converters.new_request_from_pb(msg), TENANT)
                    hit = table.get_computed_blocks(rid, TENANT)
                    args = AllocateArgs(
                        len(new.prompt) - hit.num_computed_tokens,
                        hit.num_computed_tokens,
                        hit.block_ids if hit.num_computed_tokens else (),
                    )
                    if table.allocate_slots(rid, args, TENANT).new_block_ids is None:
                        raise _refused(rid)
                for rid in finishing:
                    table.free(rid, FINISH, TENANT)
            finishing = [new.request_id for new in row]
        with table.batched():
            for rid in finishing:
                table.free(rid, FINISH, TENANT)

    return run


def _step_messages(load: Workload) -> list[tuple[bytes, RunHandle[Any] | None]]:
    """Each step serialized, with the handle of its admissions (none in the last
    step, which only finishes)."""
    messages = []
    finishing: list[str] = []
    for index, row in enumerate([*load.steps, []]):
        builder = StepBuilder(omit_request_state=True)
        admissions = None
        if row:
            ids = [new.request_id for new in row]
            builder.add_request_batch(ids, [new.prompt for new in row], [new.hashes for new in row])
            nums = [len(new.prompt) - new.num_hit for new in row]
            admissions = builder.lookup_allocate_batch(ids, nums)
        if finishing:
            builder.free_batch(finishing, [FreeMode.FINISH] * len(finishing))
        raw = builder.to_pb(index, stop_on_error=True).SerializeToString()
        messages.append((raw, admissions))
        finishing = [new.request_id for new in row]
    return messages


def _max_ops(load: Workload) -> int:
    return 4 * max(map(len, load.steps), default=1)


def _answers(load: Workload) -> list[list[tuple[ComputedBlocks, BlockIds]]]:
    """Each step's admissions as the server answers them (the hit, the blocks
    allocated), run once on a pool of their own, and checked: every entry runs and
    fits."""
    check = StepRunner(_table(load), max_ops=_max_ops(load))
    answers = []
    for raw, admissions in _step_messages(load):
        response = pb.StepResponse()
        check.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
        results = StepResults(response)
        if not results.ok:
            raise RuntimeError(f"a step of the benchmark failed: {results.errors}")
        if admissions is None:
            continue
        row = []
        for hit, allocation in results.rows(admissions):
            if allocation is None or allocation.new_block_ids is None:
                raise _refused("an admission of the step path")
            row.append((hit, allocation.new_block_ids))
        answers.append(row)
    return answers


def step_path(load: Workload) -> Callable[[], None]:
    messages = _step_messages(load)
    _answers(load)  # once beforehand, checked: every entry runs and fits
    runner = StepRunner(_table(load), max_ops=_max_ops(load))

    def run() -> None:
        for raw, _ in messages:
            response = pb.StepResponse()
            runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
            response.SerializeToString()

    return run


def link_path(load: Workload) -> Callable[[], None]:
    answers = _answers(load)
    runner = StepRunner(_table(load), max_ops=_max_ops(load))

    def run() -> None:
        link = StepLink(local_send(runner), "bench")
        finishing: list[str] = []
        for row, row_answers in zip(load.steps, answers, strict=True):
            log = link.log
            for new, (hit, blocks) in zip(row, row_answers, strict=True):
                rid = new.request_id
                log.add_request(rid, new.prompt, block_hashes=new.hashes)
                log.lookup(rid, hit)
                num_new = len(new.prompt) - hit.num_computed_tokens
                log.allocate(rid, num_new, blocks, hit=hit if hit.num_computed_tokens else None)
            for rid in finishing:
                log.free(rid, FreeMode.FINISH)
            link.flush()
            finishing = [new.request_id for new in row]
        for rid in finishing:
            link.log.free(rid, FreeMode.FINISH)
        link.flush()

    return run


LAYERS = {"core": core_path, "table": table_path, "step": step_path, "link": link_path}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=544)
    parser.add_argument("--shared", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    names = layer_names(parser, args.layers, list(LAYERS))
    if not 0 <= args.shared < args.prompt_len:
        parser.error("--shared must be >= 0 and below --prompt-len")
    load = workload(args.requests, args.steps, args.prompt_len, args.shared)
    # A fresh pool per layer and round: each run admits every request once.
    samples = time_layers(
        lambda name: LAYERS[name](load), names, args.rounds, args.steps * args.requests
    )
    print(
        f"admission steps of {args.requests} new requests ({args.prompt_len}-token prompts, "
        f"{args.shared} shared), each finished a step later; {args.steps} steps, "
        f"{args.rounds} rounds"
    )
    print_layers(samples, "us/request")


if __name__ == "__main__":
    main()
