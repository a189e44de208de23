"""The ``kvservice`` commands: the parser and what each command runs (the entry point
is ``kvservice.cli``).

``kvservice serve`` runs the gRPC service on an embedded default pool (one
full-attention group, 8 KV heads of 128, bfloat16, 4096 blocks of 16 tokens), so it
starts on any machine with no GPU and no config file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvservice import __version__
from kvservice.bench import cli as bench_cli
from kvservice.bench import demo
from kvservice.core.errors import KVCacheError
from kvservice.server.app import serve
from kvservice.server.event_loop import loop_factory
from kvservice.server.log import configure_logging
from kvservice.server.settings import (
    CONFIG_ENV,
    OPTIONS,
    Option,
    SettingsError,
    default_of,
    load_settings,
    parse_text,
)

_SERVE_EPILOG = f"""\
Every option can also be set by an environment variable (KVSERVICE_<NAME>, e.g.
KVSERVICE_NUM_BLOCKS=8192) or a key of a TOML config file (num_blocks = 8192), read
from --config or {CONFIG_ENV}. Precedence: flags > environment > config file >
defaults. Booleans take true/false, 1/0, yes/no or on/off in the environment.
"""


def _text_type(option: Option) -> Callable[[str], object]:
    def convert(raw: str) -> object:
        try:
            return parse_text(option, raw, option.flag)
        except SettingsError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = option.kind.__name__  # argparse names the type in its errors
    return convert


def _add_option(parser: argparse.ArgumentParser, option: Option) -> None:
    allowed = f"one of: {', '.join(option.choices)}; " if option.choices else ""
    text = f"{option.help} ({allowed}env {option.env}; default: {default_of(option)})"
    flags = (option.flag, *option.aliases)
    if option.kind is bool:
        parser.add_argument(
            *flags,
            dest=option.name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=text,
        )
        return
    parser.add_argument(
        *flags,
        dest=option.name,
        type=_text_type(option),
        default=None,
        choices=option.choices,
        metavar=option.name.upper(),
        help=text,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvservice",
        description="vLLM's KV-cache block manager as a gRPC service.",
        epilog="Run `kvservice serve --help` for the server's options.",
    )
    parser.add_argument("--version", action="version", version=f"kvservice {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "serve",
        help="run the gRPC service until SIGTERM/SIGINT",
        description=(
            "Run the gRPC service (and its Prometheus endpoint) until SIGTERM or SIGINT.\n"
            "With no options: gRPC on 127.0.0.1:50051, metrics on 127.0.0.1:9400, an\n"
            "embedded 4096-block pool; no GPU and no config file needed."
        ),
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"TOML file of settings (env {CONFIG_ENV}; default: none)",
    )
    for option in OPTIONS:
        _add_option(run, option)
    bench_cli.add_parser(commands)
    demo.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_cli.main(args)
    if args.command == "demo":
        return demo.main(args)
    try:
        settings = load_settings(vars(args), os.environ, args.config)
    except SettingsError as err:
        print(f"kvservice: {err}", file=sys.stderr)
        return 2
    try:
        factory = loop_factory(settings.event_loop)
    except ValueError as err:
        print(f"kvservice: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(settings.server))
    except KVCacheError as err:
        # A bad combination (pool too small, bad block size): say so, no traceback.
        print(f"kvservice: {err}", file=sys.stderr)
        return 2
    return 0
