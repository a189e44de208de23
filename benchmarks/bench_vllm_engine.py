"""A real vLLM engine on four KV cache managers, side by side in one run.

vLLM 0.32.0's CPU ``LLMEngine`` (``.venv-engine``), in this process, runs the tiny
Llama (``kvservice.integrations.vllm.tiny_model``) greedily on seeded traffic: prompts
sharing system prefixes, arrivals over the first steps, long answers, many running at
once (``engine_driver.EngineWorkload``). Only the scheduler's KV cache manager changes:

- ``stock vLLM``: vLLM's own scheduler and ``KVCacheManager``;
- ``kvservice in-process``: ``--scheduler-cls`` kvservice's, its core in this process;
- ``kvservice remote sync``: the same against a ``kvservice serve`` child process on
  loopback (its pool sized as the engine's), each step confirmed before it runs;
- ``kvservice remote overlap``: ``KVSERVICE_CONFIRM=overlap``, confirmed before the next
  step, so the round trip overlaps the forward pass;
- ``kvservice socket sync`` and ``kvservice socket overlap``: the same two with the
  steps on the server's step socket (``KVSERVICE_STEP_SOCKET``: framed, without gRPC),
  the engine's co-located transport.

Each round runs every mode once on a fresh engine (built untimed), the modes' order
rotating from round to round; one server serves all the remote runs (an engine's
session ends at its shutdown). It prints generated tokens/s per mode (median over
rounds), its ratio to stock vLLM taken within each round (median and lowest-highest),
the median ``engine.step()``, the scheduler's part of a step (``schedule()`` plus
``update_from_output()``), the round trips per step, and the CPU time per step of this
process and the server together. Every run must generate the tokens stock vLLM does
(``EngineRun.outcome()``: tokens, cached tokens, finish reasons, preemptions and
prefix-cache counters); a difference stops the benchmark with an error.

The forward pass runs on one torch thread (``--threads``): with two on a two-core
machine shared with other work, a step stalls whenever the OS deschedules either thread,
and the rounds' spread measured that rather than the scheduler.

    .venv-engine/bin/python -m benchmarks.bench_vllm_engine [--rounds 3] [--requests 64]
        [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set before vLLM is imported: the engine in this process, on the CPU, off the network.
for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_NO_USAGE_STATS": "1",
}.items():
    os.environ.setdefault(_key, _value)

from kvservice.bench.measure import process_cpu_seconds, ratio_columns, rotated  # noqa: E402
from kvservice.bench.server import child_server  # noqa: E402
from kvservice.integrations.vllm.engine_driver import (  # noqa: E402
    SCHEDULER_CLS,
    EngineRun,
    EngineSetup,
    EngineWorkload,
    build_engine,
    drive,
    shutdown,
)
from kvservice.integrations.vllm.tiny_model import build_tiny_llama  # noqa: E402

STOCK = "stock vLLM"
SETUP = EngineSetup(
    num_blocks=160,  # a few preemptions at 64 requests, none at steady state
    block_size=32,
    max_model_len=512,
    max_num_seqs=32,
    max_num_batched_tokens=512,
)
QUICK_REQUESTS = 8
QUICK_MAX_TOKENS = (8, 16)


@dataclass(frozen=True)
class Mode:
    name: str
    scheduler_cls: str | None
    confirm: str | None = None  # remote modes: KVSERVICE_CONFIRM
    step_socket: bool = False  # remote modes: steps on the server's step socket


def modes() -> list[Mode]:
    return [
        Mode(STOCK, None),
        Mode("kvservice in-process", SCHEDULER_CLS),
        Mode("kvservice remote sync", SCHEDULER_CLS, "sync"),
        Mode("kvservice remote overlap", SCHEDULER_CLS, "overlap"),
        Mode("kvservice socket sync", SCHEDULER_CLS, "sync", step_socket=True),
        Mode("kvservice socket overlap", SCHEDULER_CLS, "overlap", step_socket=True),
    ]


def workload(requests: int, quick: bool, seed: int = 0) -> EngineWorkload:
    return EngineWorkload(
        seed,
        num_requests=requests,
        shared_prefixes=4,
        max_tokens=QUICK_MAX_TOKENS if quick else (64, 128),
        arrival_steps=8 if quick else 64,
    )


@dataclass
class Measured:
    """One mode's run: what the engine produced and what it took."""

    run: EngineRun
    wall_s: float  # the whole drive(): adding requests and every step
    cpu_s: float  # this process and the server over the drive
    scheduler_s: float  # in schedule() and update_from_output()
    round_trips: int

    @property
    def steps(self) -> int:
        return len(self.run.step_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.run.generated_tokens / self.wall_s

    @property
    def step_ms(self) -> float:
        return 1000 * statistics.median(self.run.step_seconds)

    @property
    def scheduler_share(self) -> float:
        return self.scheduler_s / sum(self.run.step_seconds)


class TokensDifferError(AssertionError):
    """A mode's engine did not generate what stock vLLM generated."""


@contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) these variables for the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}

    def apply(settings: Mapping[str, str | None]) -> None:
        for key, value in settings.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    apply(values)
    try:
        yield
    finally:
        apply(saved)


class _SchedulerTimer:
    """Times the engine core's ``schedule()`` and ``update_from_output()`` by wrapping
    them on the scheduler instance (vLLM's ``EngineCore.step`` calls them through it)."""

    def __init__(self, engine: Any) -> None:
        core = getattr(engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "the engine core is not in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
        self.scheduler = core.scheduler
        self.seconds = 0.0
        for name in ("schedule", "update_from_output"):
            setattr(self.scheduler, name, self._timed(getattr(self.scheduler, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def round_trips(self) -> int:
        server = getattr(self.scheduler.kv_cache_manager, "server", None)
        return 0 if server is None else int(server.round_trips)


def _cpu_seconds(pids: list[int]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def measure(
    model: Path,
    load: EngineWorkload,
    mode: Mode,
    target: str,
    server_pid: int | None,
    step_socket: str | None = None,
) -> Measured:
    """Run ``load`` on a fresh engine in ``mode``; only the drive is timed.
    ``step_socket``: the server's, for the modes that use it."""
    remote = mode.confirm is not None
    env = {
        "KVSERVICE_TARGET": target if remote else None,
        "KVSERVICE_CONFIRM": mode.confirm if remote else None,
        "KVSERVICE_STEP_SOCKET": step_socket if mode.step_socket else None,
    }
    pids = [os.getpid()] + ([server_pid] if remote and server_pid is not None else [])
    run = EngineRun()
    with _environment(env):
        engine = build_engine(model, SETUP, mode.scheduler_cls, run)
        try:
            timer = _SchedulerTimer(engine)
            cpu, wall = _cpu_seconds(pids), time.perf_counter()
            drive(engine, load, run)
            wall, cpu = time.perf_counter() - wall, _cpu_seconds(pids) - cpu
            trips = timer.round_trips()
        finally:
            shutdown(engine)
    return Measured(run, wall, cpu, timer.seconds, trips)


def check_outcome(reference: EngineRun, run: EngineRun, mode: str, round_index: int) -> None:
    """Raise ``TokensDifferError`` unless ``run`` decided as the reference stock run did."""
    expected, actual = reference.outcome(), run.outcome()
    if actual == expected:
        return
    details = [
        f"{key}: stock {expected[key]}, {mode} {actual[key]}"
        for key in expected
        if key != "requests" and expected[key] != actual[key]
    ]
    requests, theirs = expected["requests"], actual["requests"]
    for request_id in sorted(set(requests) | set(theirs)):
        if requests.get(request_id) != theirs.get(request_id):
            details.append(
                f"{request_id}: stock {requests.get(request_id)}, {mode} {theirs.get(request_id)}"
            )
            break  # the first request that differs
    raise TokensDifferError(
        f"round {round_index + 1}: {mode} did not generate what {STOCK} generated:\n  "
        + "\n  ".join(details)
    )


def _set_torch_threads(count: int) -> None:
    import torch  # noqa: PLC0415  (vLLM imported it already)

    if torch.get_num_threads() != count:
        # Before the first engine: vLLM's CPU worker then turns set_num_threads off.
        torch.set_num_threads(count)
    if torch.get_num_threads() != count:
        print(f"note: torch keeps {torch.get_num_threads()} threads (an engine was built)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds of every mode (default 3)")
    parser.add_argument("--requests", type=int, help="requests per run (default 64)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: {QUICK_REQUESTS} short requests, 1 round, no warm-up",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the forward pass (default 1; 0: torch's own choice). With "
        "several, a step waits for every thread, and one descheduled by another process "
        "stalls it: on a small shared machine the spread is then the OS's, not the "
        "scheduler's",
    )
    args = parser.parse_args(argv)
    if args.threads:
        _set_torch_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 3)
    requests = args.requests or (QUICK_REQUESTS if args.quick else 64)
    load = workload(requests, args.quick, args.seed)
    all_modes = modes()
    runs: dict[str, list[Measured]] = {mode.name: [] for mode in all_modes}
    with tempfile.TemporaryDirectory(prefix="kvservice-tiny-llama-") as directory:
        model = build_tiny_llama(Path(directory))
        step_socket = str(Path(directory, "steps.sock"))
        server_args = [
            f"--block-size={SETUP.block_size}",
            f"--num-blocks={SETUP.num_blocks}",
            f"--max-model-len={SETUP.max_model_len}",
            f"--step-socket={step_socket}",
        ]
        with child_server(server_args) as server:
            if not args.quick:
                # The first engine of a process pays one-time costs: untimed.
                measure(model, workload(QUICK_REQUESTS, True), all_modes[0], server.target, None)
            reference: EngineRun | None = None
            for round_index in range(rounds):
                order = rotated(all_modes, round_index)
                measured = {
                    mode.name: measure(model, load, mode, server.target, server.pid, step_socket)
                    for mode in order
                }
                if reference is None:
                    reference = measured[STOCK].run
                for mode in all_modes:
                    check_outcome(reference, measured[mode.name].run, mode.name, round_index)
                    runs[mode.name].append(measured[mode.name])
    assert reference is not None
    _report(all_modes, runs, reference, requests, rounds, load)
    return 0


def _report(
    all_modes: list[Mode],
    runs: dict[str, list[Measured]],
    reference: EngineRun,
    requests: int,
    rounds: int,
    load: EngineWorkload,
) -> None:
    import torch  # noqa: PLC0415

    threads = torch.get_num_threads()
    stock = runs[STOCK]
    low, high = load.max_tokens
    print(
        f"\nvLLM CPU engine, tiny Llama: {requests} requests (max_tokens {low}-{high - 1}), "
        f"max_num_seqs {SETUP.max_num_seqs}, {SETUP.num_blocks} blocks of "
        f"{SETUP.block_size} tokens, {threads} torch thread(s); "
        f"{stock[0].steps} steps x {rounds} rounds"
    )
    print(
        f"{'mode':<26}{'tokens/s':>9}{'ratio':>8}{'spread':>13}{'step ms':>9}"
        f"{'sched ms/step':>15}{'sched share':>13}{'trips/step':>12}{'CPU ms/step':>13}"
    )
    for mode in all_modes:
        mine = runs[mode.name]
        ratios = [m.tokens_per_s / s.tokens_per_s for m, s in zip(mine, stock, strict=True)]
        print(
            f"{mode.name:<26}{statistics.median(m.tokens_per_s for m in mine):>9.0f}"
            f"{ratio_columns(ratios)}"
            f"{statistics.median(m.step_ms for m in mine):>9.2f}"
            f"{statistics.median(1000 * m.scheduler_s / m.steps for m in mine):>15.2f}"
            f"{statistics.median(100 * m.scheduler_share for m in mine):>12.0f}%"
            f"{statistics.median(m.round_trips / m.steps for m in mine):>12.2f}"
            f"{statistics.median(1000 * m.cpu_s / m.steps for m in mine):>13.2f}"
        )
    print(
        f"tokens: every mode generated stock vLLM's in every round ({reference.generated_tokens} "
        f"tokens, {reference.preemptions} preemptions, {reference.prefix_cache_hits}/"
        f"{reference.prefix_cache_queries} prefix-cache hits/queries)"
    )
    print(
        "ratio: this mode's tokens/s over stock vLLM's, within each round (median, "
        "lowest-highest); step ms: the median engine.step(); sched: schedule() plus "
        "update_from_output(), its share of the steps' time; CPU: this process and, "
        "remote, the server"
    )


if __name__ == "__main__":
    raise SystemExit(main())
