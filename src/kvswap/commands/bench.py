"""`kvswap bench`: measure the host<->device link before tuning anything."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvswap.bench.bandwidth import run_bandwidth_bench
from kvswap.bench.report import BenchReport, save_report
from kvswap.commands.outputs import attempt_write, check_output_file
from kvswap.config_load import load_config
from kvswap.errors import KvSwapError
from kvswap.units import format_bytes, parse_size_bytes


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "bench",
        help="measure host<->device copy bandwidth and the swap path's gather efficiency",
        description="Copy bandwidth from 1 MiB to 1 GiB (pinned and pageable host memory), and "
        "the gather of scattered KV blocks into one chunk. Without CUDA it measures host memory "
        "copies and says so.",
    )
    parser.add_argument("--full", action="store_true", help="every size from 1 MiB to 1 GiB")
    parser.add_argument(
        "--block-bytes",
        default="2MiB",
        metavar="SIZE",
        help="KV block size for the gather test (default 2MiB)",
    )
    parser.add_argument(
        "--chunk-blocks",
        default="4,8,16",
        metavar="N,N,...",
        help="blocks per gathered chunk (default 4,8,16)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, metavar="N",
        help="timed copies per size; the best is kept (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="the device end of the link (default auto: CUDA when present)",
    )  # fmt: skip
    parser.add_argument("--out", metavar="FILE", help="save the result as JSON for plan/simulate")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # No setting applies to a link measurement, but a KVSWAP_* typo is refused here as
    # by every other command, rather than silently ignored.
    load_config()
    check_output_file(args.out, "--out")  # before minutes of copies, not after
    block_bytes = parse_size_bytes(args.block_bytes, "--block-bytes")
    try:
        chunk_blocks = tuple(int(part) for part in args.chunk_blocks.split(","))
    except ValueError:
        raise KvSwapError(
            f"--chunk-blocks = {args.chunk_blocks!r}: expected block counts such as 4,8,16"
        ) from None
    report = run_bandwidth_bench(
        full=args.full,
        block_bytes=block_bytes,
        chunk_blocks=chunk_blocks,
        repeats=args.repeats,
        device=None if args.device == "auto" else args.device,
        progress=None if args.json else _progress,
    )
    path = args.out
    failure = (
        None if path is None else attempt_write(lambda: save_report(report, path), "--out", path)
    )
    if args.json:
        print(json.dumps(report.to_json_dict(), indent=2))
    else:
        print(render(report))
        if path is not None and failure is None:
            print(f"saved to {path}")
    if failure is not None:
        raise failure  # after the figures: a measurement is never thrown away
    return 0


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def render(report: BenchReport) -> str:
    lines = [f"device: {report.device} ({report.device_name})"]
    if report.note:
        lines.append(f"note: {report.note}")
    lines.append(
        f"{'op':<13}{'memory':<10}{'size':>12}{'median GB/s':>13}{'min':>8}{'max':>8}"
        f"{'vs memcpy':>11}"
    )
    for row in report.results:
        ratio = "" if row.ratio_to_memcpy is None else f"{row.ratio_to_memcpy:.2f}"
        size = format_bytes(row.num_bytes)
        if row.num_blocks is not None and row.block_bytes is not None:
            size = f"{row.num_blocks}x{format_bytes(row.block_bytes).replace(' ', '')}"
        lines.append(
            f"{row.op:<13}{row.memory:<10}{size:>12}{row.gb_per_s_median:>13.2f}"
            f"{row.gb_per_s_min:>8.2f}{row.gb_per_s_max:>8.2f}{ratio:>11}"
        )
    return "\n".join(lines)
