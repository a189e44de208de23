"""``kvservice``: the command line entry point.

``kvservice serve`` runs the gRPC service on an embedded default pool (one
full-attention group, 8 KV heads of 128, bfloat16, 4096 blocks of 16 tokens), so it
starts on any machine with no GPU and no config file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from kvservice.core.block_hashing import HASH_FUNCTIONS
from kvservice.core.errors import KVCacheError
from kvservice.server.app import serve
from kvservice.server.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, ServerConfig
from kvservice.server.log import LOG_LEVELS, configure_logging

_DEFAULTS = ServerConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvservice", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the gRPC service until SIGTERM/SIGINT")
    run.add_argument("--host", default=_DEFAULTS.host, help="gRPC bind address")
    run.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free)")
    run.add_argument("--metrics-host", default=_DEFAULTS.metrics_host)
    run.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (0 disables it)",
    )
    run.add_argument("--num-blocks", type=int, default=_DEFAULTS.num_blocks)
    run.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    run.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len)
    run.add_argument("--hash-algo", choices=sorted(HASH_FUNCTIONS), default=_DEFAULTS.hash_algo)
    run.add_argument(
        "--none-hash-seed",
        default=None,
        help="prefix hash chain seed (set one to share an xxhash cache across processes)",
    )
    run.add_argument(
        "--zero-new-blocks",
        action="store_true",
        help="report freshly allocated blocks for the runtime to zero",
    )
    run.add_argument("--model-name", default=_DEFAULTS.model_name, help="metrics label")
    run.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    run.add_argument(
        "--shutdown-grace",
        type=float,
        default=_DEFAULTS.shutdown_grace_s,
        help="seconds in-flight RPCs get on shutdown",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port or None,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        hash_algo=args.hash_algo,
        none_hash_seed=args.none_hash_seed,
        needs_kv_cache_zeroing=args.zero_new_blocks,
        model_name=args.model_name,
        shutdown_grace_s=args.shutdown_grace,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        asyncio.run(serve(config_from_args(args)))
    except KVCacheError as err:
        # A bad flag combination (pool too small, bad block size): say so, no traceback.
        print(f"kvservice: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
