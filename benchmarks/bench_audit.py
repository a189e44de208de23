"""How long the pool audit stops the server's loop: in place vs in a forked snapshot.

Builds a pool (1M blocks by default), holds about half of it with 1000-token requests,
then runs the audit alternately in place and forked (``kvservice.server.audit``),
``--rounds`` times each, interleaved, while a ticker task on the same loop records the
longest gap between its wake-ups: the time no RPC could have been served. Prints, per
mode, the median audit time and the median longest stall, and the ratio of the stalls
measured side by side. Run: ``python -m benchmarks.bench_audit [--num-blocks N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, NewRequest
from kvservice.server.audit import Auditor
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.sessions import SessionPolicy, SessionRegistry

PROMPT_TOKENS = 1000
TICK_S = 0.001


def build(num_blocks: int) -> RequestTable:
    table = RequestTable(build_manager(ServerConfig(num_blocks=num_blocks, metrics_port=None)))
    blocks_per_request = -(-PROMPT_TOKENS // 16)
    for i in range((num_blocks // 2) // blocks_per_request):
        table.add_request(
            NewRequest(f"r{i}", list(range(i * 7, i * 7 + PROMPT_TOKENS))), tenant=DEFAULT_TENANT
        )
        table.allocate_slots(
            f"r{i}", AllocateArgs(num_new_tokens=PROMPT_TOKENS), tenant=DEFAULT_TENANT
        )
    return table


async def longest_stall(audit: Auditor) -> tuple[float, float]:
    """(audit seconds, longest gap between ticks while it ran)."""
    stop = asyncio.Event()
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(TICK_S * 5)  # the ticker is running before the audit starts
    start = time.perf_counter()
    report = await audit.run()
    elapsed = time.perf_counter() - start
    stop.set()
    await ticker
    assert report.ok, report.violations
    return elapsed, worst


async def main(num_blocks: int, rounds: int) -> None:
    table = build(num_blocks)
    # As ``kvservice serve`` does: the pool's objects out of the collector's reach.
    gc.collect()
    gc.freeze()
    registry = SessionRegistry(table, SessionPolicy())
    modes = {
        "in place": Auditor(table, registry, fork_min_blocks=num_blocks + 1),
        "forked": Auditor(table, registry, fork_min_blocks=0),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, auditor in modes.items():
            results[name].append(await longest_stall(auditor))
    usage = table.usage()
    print(
        f"pool: {num_blocks} blocks, {usage.num_used_blocks} held by "
        f"{usage.num_requests} requests; {rounds} rounds per mode, interleaved"
    )
    stalls = {}
    for name, runs in results.items():
        audit_s = statistics.median(r[0] for r in runs)
        stalls[name] = statistics.median(r[1] for r in runs)
        print(
            f"{name:>9}: audit {audit_s * 1000:9.1f} ms   longest loop stall "
            f"{stalls[name] * 1000:9.1f} ms"
        )
    print(f"loop stall, in place / forked: {stalls['in place'] / stalls['forked']:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.num_blocks, args.rounds))
