"""``kvservice demo``: a server with the co-located torch runtime on CPU, a short
shared-prefix workload through the reference scheduler over a ``StepStream`` session,
what it did to the pool (hits, evictions, preemptions, usage) and where to look."""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvservice.bench.server import ChildServer, ServerStartError, child_server
from kvservice.client import KVClient
from kvservice.scheduler.loop import Scheduler, SchedulerConfig, StepRecord
from kvservice.scheduler.replicated import StreamBackend
from kvservice.workloads import LengthDistribution, SharedSystemPromptConfig, generate

# A small model shape, so the runtime's KV tensors take a few MiB of CPU memory, and a
# pool that many requests sharing one system prompt overflow: the prefix cache hits,
# cached blocks get evicted and running requests get preempted.
NUM_BLOCKS = 160
MAX_MODEL_LEN = 1024
SERVER_FLAGS = (
    "--runtime=torch",
    "--device=cpu",
    f"--num-blocks={NUM_BLOCKS}",
    "--block-size=16",
    f"--max-model-len={MAX_MODEL_LEN}",
    "--num-layers=2",
    "--num-kv-heads=2",
    "--head-size=64",
    "--dtype=float32",
    "--model-name=demo",
)
WORKLOAD = SharedSystemPromptConfig(
    num_requests=64,
    num_system_prompts=2,
    system_prompt_len=384,
    user_len=LengthDistribution(median=96, sigma=0.7, low=8, high=384),
    output_len=LengthDistribution(median=48, sigma=0.6, low=4, high=192),
    requests_per_step=2.0,
    max_model_len=MAX_MODEL_LEN,
)
SCHEDULER = SchedulerConfig(
    max_model_len=MAX_MODEL_LEN,
    max_num_batched_tokens=1024,
    max_num_running_reqs=24,
    full_sequence_must_fit=False,  # admit optimistically, so decoding runs out of room
)
# Metric families the summary reads, by their exposition name (counters sum labels).
_METRICS = {
    "vllm:prefix_cache_queries": "prefix cache queries (tokens)",
    "vllm:prefix_cache_hits": "prefix cache hits (tokens)",
    "vllm:num_preemptions": "preemptions",
    "kvservice_evictions": "cached blocks evicted",
    "kvservice_allocations": "allocations",
}


def add_parser(commands: Any) -> None:
    """Register ``demo`` on the ``kvservice`` subcommands."""
    commands.add_parser(
        "demo",
        help="start a server with the torch runtime, run a shared-prefix workload, report",
        description=(
            "Start `kvservice serve --runtime torch --device cpu` on free loopback ports,\n"
            f"run {WORKLOAD.num_requests} requests behind {WORKLOAD.num_system_prompts} "
            "shared system prompts through the reference\n"
            f"scheduler on a {NUM_BLOCKS}-block pool, print the prefix hits, evictions,\n"
            "preemptions and usage, then shut the server down. Needs torch\n"
            "(pip install 'kvservice[runtime]'); about 10-20 s on two cores."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


@dataclass(frozen=True, slots=True)
class DemoRun:
    runtime: str
    records: list[StepRecord]
    seconds: float
    peak_usage: float
    num_sends: int


def _run(server: ChildServer) -> DemoRun:
    specs = generate(WORKLOAD, seed=0)
    with KVClient(server.target) as client, StreamBackend(client) as backend:
        cache = client.get_cache_config()
        runtime = (
            f"runtime on {cache.runtime_device}: fresh blocks zeroed by the server before "
            "each answer"
            if cache.blocks_zeroed_by_server
            else "no runtime in the server"
        )
        scheduler = Scheduler(backend, SCHEDULER, specs)
        records: list[StepRecord] = []
        peak = 0.0
        start = time.perf_counter()
        while not scheduler.done:
            records.append(scheduler.step())
            peak = max(peak, 1 - backend.num_free_blocks() / (NUM_BLOCKS - 1))
        backend.flush()  # the last step's frees
        seconds = time.perf_counter() - start
        return DemoRun(runtime, records, seconds, peak, backend.round_trips)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode("utf-8")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in _METRICS:
            totals[family.name] = sum(
                s.value for s in family.samples if not s.name.endswith("_created")
            )
    return totals


def _report(run: DemoRun, metrics: dict[str, float], server: ChildServer) -> str:
    scheduled = [s for r in run.records for s in r.scheduled]
    preemptions = sum(len(r.preempted) for r in run.records)
    finished = sum(len(r.finished) for r in run.records)
    queries = metrics.get("vllm:prefix_cache_queries", 0.0)
    hits = metrics.get("vllm:prefix_cache_hits", 0.0)
    lines = [
        f"ran {finished} requests in {len(run.records)} scheduler steps "
        f"({run.seconds:.1f} s, {run.num_sends} StepStream messages, "
        f"{sum(s.num_new_tokens for s in scheduled)} tokens computed)",
        f"prefix cache: {hits:.0f} of {queries:.0f} looked-up tokens hit "
        f"({hits / queries if queries else 0:.1%})",
        f"preemptions: {preemptions} (server counted {metrics.get('vllm:num_preemptions', 0):.0f})",
        f"cached blocks evicted: {metrics.get('kvservice_evictions', 0):.0f}",
        f"peak KV usage: {run.peak_usage:.1%} of {NUM_BLOCKS - 1} blocks; {run.runtime}",
        f"metrics (while the server ran): {server.metrics_url}",
        "keep one running with: kvservice serve --runtime torch --device cpu",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``kvservice demo``; the exit status."""
    del args  # no options
    print("starting kvservice serve --runtime torch --device cpu ...", file=sys.stderr)
    try:
        with child_server(SERVER_FLAGS, metrics=True) as server:
            print(f"server on {server.target} (pid {server.pid})", file=sys.stderr)
            run = _run(server)
            metrics = _scrape(server.metrics_url or "")
            print(_report(run, metrics, server))
    except ServerStartError as err:
        print(f"kvservice demo: {err}", file=sys.stderr)
        return 1
    print("server stopped", file=sys.stderr)
    return 0
