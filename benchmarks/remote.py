"""The remote tier on loopback: bandwidth, a later turn's TTFT, a second process.

Measured side by side in one run; every section checks it exercised what it
names before it reports a ratio.

  bandwidth  bytes/s to and from the store through RemoteCopyEngine vs plain redis-py
             SET / GET of the same bytes (goal: >= 0.8 each way)
  ttft       a later turn's TTFT with turn 1's KV recomputed / restored from the pinned
             CPU pool / restored from the store by a new engine: remote/recompute and
             remote/CPU, prefix hits per tier, outputs identical
  second     a shared-prompt workload served by a fresh engine after another filled the
             store, vs a fresh engine without the tier: tokens/s and TTFT P50 ratios
  cluster    a private 3-master Redis Cluster (remote_cluster.py): the bandwidth
             section's ratios against plain redis-py's RedisCluster, and each
             master's share of a namespace's block keys

Without `--url` it starts a private redis-server on a free loopback port in a
temporary directory (tests/redis_server.py) and stops it at the end, whatever
happens. A store given with `--url` is emptied (FLUSHDB) by every section: use
one that holds nothing else. Prints each section's shapes and figures, goals
beside the ratios; `--json` prints one JSON object instead (tables go to
stderr). Exit status 1 when a section failed, 2 for a usage error. Timings
from a shared machine are noise: take final figures on a quiet one. On a
machine whose cores other processes use, pass `--threads 1`: torch's threads
waiting on each other at every 8-row tile of the exact mode made the same run
10-40x slower, at random.

    .venv/bin/python benchmarks/remote.py --quick --threads 1   # validation, ~1 min
    .venv/bin/python benchmarks/remote.py --json --out remote.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine import record_failure, run_section, to_json
from engine_support import Bench, Result, section_names, warm_up
from kvswap.commands.outputs import check_output_file
from kvswap.data.remote_copy import (
    DEFAULT_READ_LANES,
    DEFAULT_WRITE_LANES,
    READ_BATCH_BYTES,
    WRITE_BATCH_BYTES,
)
from kvswap.errors import KvSwapError
from kvswap.signals import Terminated, report_stop, stop_signals_raise
from kvswap.units import parse_size_bytes
from machine import result_header
from remote_bandwidth import section_bandwidth
from remote_cluster import section_cluster
from remote_sections import section_second, section_ttft

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.redis_server import RedisServer, redis_server_missing

SECTION_NAMES = ("bandwidth", "ttft", "second", "cluster")
#: The sections that run the engine (a warm-up run first, once).
ENGINE_SECTIONS = ("ttft", "second")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=None, help="a store to use and FLUSH (default: private)")
    every = ",".join(SECTION_NAMES)
    parser.add_argument("--sections", default=every, help=f"a comma-separated subset of {every}")
    parser.add_argument("--quick", action="store_true", help="small shapes, for validation")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON object here")
    engine = parser.add_argument_group("ttft, second: the engine")
    engine.add_argument("--model", default="small", help="a preset or checkpoint (small)")
    engine.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    default_threads = os.cpu_count() or 1
    engine.add_argument("--threads", type=int, default=default_threads,
                        help=f"torch threads ({default_threads})")  # fmt: skip
    bandwidth = parser.add_argument_group("bandwidth")
    bandwidth.add_argument(
        "--block-bytes", default=None, help="bytes per block (1MiB; quick 256KiB)"
    )
    bandwidth.add_argument("--num-blocks", type=int, default=None, help="per pass (64; quick 16)")
    bandwidth.add_argument("--chunk-blocks", type=int, default=8, help="blocks per chunk (8)")
    bandwidth.add_argument("--repeats", type=int, default=3, help="timed passes (3)")
    bandwidth.add_argument("--read-lanes", type=int, default=DEFAULT_READ_LANES)
    bandwidth.add_argument("--write-lanes", type=int, default=DEFAULT_WRITE_LANES)
    bandwidth.add_argument("--read-batch-bytes", default=str(READ_BATCH_BYTES))
    bandwidth.add_argument("--write-batch-bytes", default=str(WRITE_BATCH_BYTES))
    args = parser.parse_args(argv)
    args.names = section_names(args.sections, SECTION_NAMES)
    if args.block_bytes is None:
        args.block_bytes = "256KiB" if args.quick else "1MiB"
    args.block_bytes = parse_size_bytes(args.block_bytes, "--block-bytes")
    if args.num_blocks is None:
        args.num_blocks = 16 if args.quick else 64
    for name in ("read_batch_bytes", "write_batch_bytes"):
        setattr(args, name, parse_size_bytes(getattr(args, name), f"--{name.replace('_', '-')}"))
    for name in ("num_blocks", "chunk_blocks", "repeats", "read_lanes", "write_lanes", "threads"):
        if getattr(args, name) < 1:
            raise KvSwapError(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed: >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise KvSwapError("--device cuda but CUDA is not available here; use --device cpu")
    check_output_file(args.out, "--out")  # before minutes of runs, not after
    return args


def sections(args: argparse.Namespace, bench: Bench) -> dict[str, Callable[[str], Result]]:
    """name -> the section, given the store's URL; in the order they run."""
    bandwidth_options = {
        "num_blocks": args.num_blocks, "block_bytes": args.block_bytes,
        "chunk_blocks": args.chunk_blocks, "repeats": args.repeats,
        "num_read_lanes": args.read_lanes, "num_write_lanes": args.write_lanes,
        "read_batch_bytes": args.read_batch_bytes, "write_batch_bytes": args.write_batch_bytes,
    }  # fmt: skip
    every: dict[str, Callable[[str], Result]] = {
        "bandwidth": functools.partial(section_bandwidth, **bandwidth_options),
        "ttft": functools.partial(section_ttft, bench),
        "second": functools.partial(section_second, bench),
        "cluster": functools.partial(section_cluster, **bandwidth_options),
    }
    return {name: every[name] for name in SECTION_NAMES if name in args.names}


@contextlib.contextmanager
def store_url(url: str | None) -> Iterator[str]:
    """`url`, or a private redis-server's, stopped and its directory removed on exit."""
    if url is not None:
        yield url
        return
    missing = redis_server_missing()
    if missing is not None:
        raise KvSwapError(f"no --url and {missing}")
    with (
        tempfile.TemporaryDirectory(prefix="kvswap-bench-redis-") as work_dir,
        RedisServer(Path(work_dir)).start() as server,
    ):
        yield server.url


def run_sections(args: argparse.Namespace, bench: Bench, url: str, report: dict[str, Any]) -> None:
    """Each section in turn; one that breaks or did not exercise what it names is
    recorded as failed (loud) and the others still run."""
    stream = sys.stderr if args.json else sys.stdout
    chosen = sections(args, bench)
    if any(name in ENGINE_SECTIONS for name in chosen):
        try:
            warm_up(bench)  # a device's one-time start is paid before anything is timed
        except Exception as error:  # every engine section would meet it again: once here
            record_failure(report, "warm_up", error)
    for name, section in chosen.items():
        run_section(report, name, functools.partial(section, url), stream, args.out)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except KvSwapError as error:
        print(f"remote.py: error: {error}", file=sys.stderr)
        return 2
    bench = Bench(args.model, args.device, args.threads, args.quick)
    report: dict[str, Any] = {
        **result_header("remote", "remote.py", argv),
        "quick": args.quick, "model": args.model, "device": args.device,
        "torch_threads": args.threads, "store": "--url" if args.url else "private loopback",
        "sections": {}, "failed": {},
    }  # fmt: skip
    try:
        # A stop signal unwinds like Ctrl-C: the private server stops, its directory goes.
        with stop_signals_raise(), store_url(args.url) as url:
            run_sections(args, bench, url, report)
    except KvSwapError as error:  # no redis-server, or a store that cannot be used
        print(f"remote.py: error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        return report_stop(stop)
    if args.json:
        print(to_json(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
