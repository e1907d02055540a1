"""The `kvswap` command line: argparse wiring only; each command lives in kvswap.commands."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from kvswap import __version__
from kvswap.commands import bench as bench_command
from kvswap.commands import checkpoint as checkpoint_command
from kvswap.commands import generate as generate_command
from kvswap.commands import loadgen as loadgen_command
from kvswap.commands import plan as plan_command
from kvswap.commands import report as report_command
from kvswap.commands import run as run_command
from kvswap.commands import serve as serve_command
from kvswap.commands import simulate as simulate_command
from kvswap.commands import tune as tune_command
from kvswap.errors import KvSwapError
from kvswap.signals import Terminated, report_stop, stop_signals_raise

EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, but a flag named in a help line is never split at its hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line and exits with 2, and takes
    no abbreviation of a flag (`--prompt` is never taken for `--prompt-ids`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvswap",
        description="Tiered KV cache for LLM inference: plan the memory bill, measure the link, "
        "run and simulate KV offload.",
    )
    parser.add_argument("--version", action="version", version=f"kvswap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    plan_command.register(commands)
    bench_command.register(commands)
    run_command.register(commands)
    serve_command.register(commands)
    generate_command.register(commands)
    report_command.register(commands)
    simulate_command.register(commands)
    tune_command.register(commands)
    loadgen_command.register(commands)
    checkpoint_command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user mistake exits 2 with one line; SIGINT, SIGTERM, SIGHUP
    and SIGQUIT unwind every `with` (releasing the pools), print one line and exit
    with 128 + the signal number. Neither ever shows a traceback."""
    try:
        with stop_signals_raise():
            parser = build_parser()
            args = parser.parse_args(argv)
            result: int = args.handler(args)
    except KvSwapError as error:
        print(f"kvswap: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, Terminated) as stop:
        return report_stop(stop)
    return result
