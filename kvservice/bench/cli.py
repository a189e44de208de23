"""``kvservice bench``: the command line of the benchmark."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvservice.bench.report import plot, table, to_json
from kvservice.bench.runner import (
    IN_PROCESS,
    MODES,
    WORKLOAD_KINDS,
    BenchConfig,
    Connect,
    ServerFactory,
    run_bench,
)
from kvservice.bench.server import ChildServer, ServerStartError, child_server
from kvservice.client import KVClient, KVServiceError, ServiceUnavailableError
from kvservice.server.config import ServerConfig

T = TypeVar("T")

DEFAULTS = BenchConfig()
# Tiny sizes that still admit, finish and preempt: a few seconds on two cores.
SMOKE = BenchConfig(
    num_requests=48,
    num_blocks=(96,),
    max_steps=40,
    rounds=1,
    max_running=16,
    max_batched_tokens=1024,
    arrival_rate=4.0,
    max_model_len=1024,
)

DESCRIPTION = """\
Run a workload through the reference scheduler (vLLM's loop: token budget, chunked
prefill, admission, preemption) in several modes and print them side by side:

  in-process  the scheduler calls the request table in this process
  unary       one gRPC call per request-table call
  step        a replica request table in the scheduler's process answers every
              call; each step goes to the server as one Step RPC, whose answers
              are checked while the next step is planned (the server's work
              overlaps the scheduler's)
  stream      the same steps on one long-lived StepStream

Rounds alternate the order of the modes so machine noise hits them all; every ratio
comes from this one run. Unless --target is given, a `kvservice serve` child process
is started per pool size on a free loopback port and stopped at the end.
"""

EPILOG = """\
Columns: steps/s and ops/s (request-table operations per second), p50/p99 step
latency, "p99 full" over the steps that scheduled --max-running requests, messages
per step, CPU ms per step (this process plus the server it started: steadier than
the wall clock on a busy machine), and steps/s as a ratio to in-process and to the
first --num-blocks pool; then each step split in two, p50/p99 of the time inside the KV
backend ("kv": the service's calls, RPCs included) and of the rest ("sched": the
scheduler's own Python). Exit status 1 if any mode made different decisions from the
in-process reference.
"""


def _positive(kind: Callable[[str], T]) -> Callable[[str], T]:
    def convert(raw: str) -> T:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
        if not value > 0:  # type: ignore[operator]
            raise argparse.ArgumentTypeError(f"must be > 0, got {raw!r}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _block_counts(raw: str) -> tuple[int, ...]:
    counts = []
    for part in raw.split(","):
        try:
            count = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a block count: {part!r}") from None
        if count < 2:
            raise argparse.ArgumentTypeError(f"a pool needs >= 2 blocks, got {count}")
        counts.append(count)
    return tuple(counts)


def _modes(raw: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in raw.split(",") if part.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"modes must be distinct names among {', '.join(MODES)}; got {raw!r}"
        )
    return modes


def add_parser(commands: Any) -> None:
    """Register ``bench`` on the ``kvservice`` subcommands."""
    parser = commands.add_parser(
        "bench",
        help="benchmark the scheduler in-process vs over gRPC (unary, Step, StepStream)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    add = parser.add_argument
    add(
        "--workload",
        choices=WORKLOAD_KINDS,
        default=None,
        help=f"request pattern (default: {d.workload}: many users behind one system prompt)",
    )
    add(
        "--requests",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"requests the workload submits (default: {d.num_requests})",
    )
    add(
        "--num-blocks",
        type=_block_counts,
        default=None,
        metavar="N[,N...]",
        help="pool size(s) in blocks, null block included; several sizes are measured "
        f"side by side (default: {d.num_blocks[0]})",
    )
    add("--seed", type=int, default=None, help=f"workload and sampling seed (default: {d.seed})")
    add(
        "--modes",
        type=_modes,
        default=None,
        metavar="M[,M...]",
        help=f"modes to compare (default: {','.join(MODES)})",
    )
    add(
        "--steps",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"scheduling steps per run, at most (default: {d.max_steps})",
    )
    add(
        "--rounds",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"runs of every mode, alternating their order (default: {d.rounds})",
    )
    add(
        "--max-running",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"most requests running at once (default: {d.max_running})",
    )
    add(
        "--max-batched-tokens",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"token budget of one step (default: {d.max_batched_tokens})",
    )
    add(
        "--arrival-rate",
        type=_positive(float),
        default=None,
        metavar="R",
        help=f"mean requests arriving per step (default: {d.arrival_rate})",
    )
    add(
        "--max-model-len",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"longest sequence in tokens (default: {d.max_model_len})",
    )
    add(
        "--target",
        default=None,
        metavar="HOST:PORT",
        help="benchmark this running server instead of starting one (its pool must be "
        "idle: the bench resets its prefix cache)",
    )
    add(
        "--token",
        default=None,
        metavar="TOKEN",
        help="bearer token for a --target with tokens (the bench resets its prefix cache: "
        "an admin tenant's); needs --tls-ca unless --allow-insecure-token",
    )
    add(
        "--tls-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="CA certificate(s) to check a --target that serves TLS (turns TLS on)",
    )
    add("--tls-cert", type=Path, default=None, metavar="PEM", help="client certificate (mTLS)")
    add("--tls-key", type=Path, default=None, metavar="PEM", help="client key (mTLS)")
    add(
        "--allow-insecure-token",
        action="store_true",
        help="send --token over plaintext (a loopback server without TLS)",
    )
    add(
        "--eviction-policy",
        choices=("lru", "priority"),
        default=None,
        help="the pool's eviction policy (default: lru, vLLM's)",
    )
    add(
        "--system-prompt-priority",
        type=int,
        default=None,
        metavar="P",
        help="keep the shared_system_prompt workload's system prompts at eviction "
        "priority P (0-100; needs --eviction-policy priority)",
    )
    add("--json", action="store_true", help="print the results as JSON instead of the table")
    add(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw usage, prefix hit rate and step latency over time (needs matplotlib: "
        "pip install 'kvservice[plot]')",
    )
    add(
        "--smoke",
        action="store_true",
        help="tiny sizes (a few seconds); explicit flags still override them",
    )
    add("--no-progress", action="store_true", help="no progress bar on stderr")


_FLAGS = {
    "workload": "workload",
    "requests": "num_requests",
    "num_blocks": "num_blocks",
    "seed": "seed",
    "modes": "modes",
    "steps": "max_steps",
    "rounds": "rounds",
    "max_running": "max_running",
    "max_batched_tokens": "max_batched_tokens",
    "arrival_rate": "arrival_rate",
    "max_model_len": "max_model_len",
    "eviction_policy": "eviction_policy",
    "system_prompt_priority": "system_prompt_priority",
}


def config_from(args: argparse.Namespace) -> BenchConfig:
    """Defaults (or the smoke sizes), then every flag given."""
    base = SMOKE if args.smoke else DEFAULTS
    given = {field: getattr(args, flag) for flag, field in _FLAGS.items()}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def _spawned(pool: ServerConfig) -> contextlib.AbstractContextManager[ChildServer]:
    @contextlib.contextmanager
    def run() -> Iterator[ChildServer]:
        flags = [
            f"--num-blocks={pool.num_blocks}",
            f"--block-size={pool.block_size}",
            f"--max-model-len={pool.max_model_len}",
            f"--hash-algo={pool.hash_algo}",
            f"--eviction-policy={pool.eviction_policy}",
        ]
        with child_server(flags) as server:
            yield server

    return run()


def _existing(target: str) -> ServerFactory:
    @contextlib.contextmanager
    def run(pool: ServerConfig) -> Iterator[ChildServer]:
        # Another process's server: its CPU time is not ours to read (pid unknown).
        yield ChildServer(target, None, None)

    return run


def _connector(args: argparse.Namespace) -> Connect:
    """The clients of --target: its token and TLS files (read now, so a missing file
    fails before anything runs)."""
    return functools.partial(
        KVClient,
        token=args.token,
        allow_insecure_token=args.allow_insecure_token,
        root_certificates=_read(args.tls_ca, "--tls-ca"),
        certificate_chain=_read(args.tls_cert, "--tls-cert"),
        private_key=_read(args.tls_key, "--tls-key"),
    )


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None


def _fit_to_target(config: BenchConfig, target: str, connect: Connect) -> BenchConfig:
    """The in-process pool must be the target's, or the modes would not compare."""
    if len(config.num_blocks) > 1:
        raise ValueError("--target measures one pool: give at most one --num-blocks")
    try:
        with connect(target) as client:
            cache = client.get_cache_config()
            if not client.reset_prefix_cache():
                raise ValueError(f"--target {target}: the server has requests holding blocks")
    except ServiceUnavailableError as err:
        raise ValueError(
            f"--target {target}: no answer ({err.message}); is a server listening there? A "
            f"server with TLS needs --tls-ca, one with tokens --token"
        ) from None
    except KVServiceError as err:
        raise ValueError(f"--target {target}: {err}") from None
    return dataclasses.replace(
        config,
        num_blocks=(cache.num_blocks,),
        max_model_len=cache.max_model_len,
        block_size=cache.scheduler_block_size,
    )


def main(args: argparse.Namespace) -> int:
    """Run ``kvservice bench``; the exit status."""
    config = config_from(args)
    if config.system_prompt_priority is not None and config.eviction_policy != "priority":
        print(
            "kvservice bench: --system-prompt-priority needs --eviction-policy priority "
            "(an LRU pool refuses requests that carry priorities)",
            file=sys.stderr,
        )
        return 2
    if config.system_prompt_priority is not None and not 0 <= config.system_prompt_priority <= 100:
        print("kvservice bench: --system-prompt-priority must be in [0, 100]", file=sys.stderr)
        return 2
    server_for: ServerFactory | None = None
    connect: Connect = KVClient
    if config.modes != (IN_PROCESS,):
        if args.target is not None:
            try:
                connect = _connector(args)
                config = _fit_to_target(config, args.target, connect)
            except ValueError as err:  # InsecureTokenError included
                print(f"kvservice bench: {err}", file=sys.stderr)
                return 2
            server_for = _existing(args.target)
        else:
            server_for = _spawned
    try:
        pools = run_bench(
            config, server_for, progress_enabled=not args.no_progress, connect=connect
        )
    except ServerStartError as err:
        print(f"kvservice bench: {err}", file=sys.stderr)
        return 1
    document = to_json(config, pools)
    print(json.dumps(document, indent=2) if args.json else table(document))
    if args.plot is not None:
        plot(pools, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if not all(m["decisions_match"] for p in document["pools"] for m in p["modes"]):
        print("kvservice bench: a mode made different decisions", file=sys.stderr)
        return 1
    return 0
