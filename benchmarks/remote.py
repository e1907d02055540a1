"""Remote tier vs plain redis-py: bytes/s to and from a Redis store, in one run.

Moves `--num-blocks` blocks of `--block-bytes` from a HostPool to the store and
back through RemoteCopyEngine (`--chunk-blocks` per chunk, every value with
its header and CRC-32 checked on the way back), and the same bytes with plain
redis-py (`Redis.from_url(url)`, one SET / GET per block, its default
settings), and prints the rates side by side as a ratio (goal: >= 0.8 each
way). Without `--url` it starts a private redis-server on loopback (the
tests' helper) and removes it afterwards. The last line is one JSON object.

    .venv/bin/python benchmarks/remote.py --num-blocks 64 --block-bytes 1MiB

Figures from a shared or busy machine are noise: take the final ones on a
quiet one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import torch

from kvswap.control.transfer import Direction, Priority, TransferChunk
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import (
    DEFAULT_READ_LANES,
    DEFAULT_WRITE_LANES,
    READ_BATCH_BYTES,
    WRITE_BATCH_BYTES,
    RemoteCopyEngine,
)
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
from kvswap.units import parse_size_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.redis_server import RedisServer, redis_server_missing

GOAL_RATIO = 0.8


def _chunks(
    direction: Direction, keys: list[bytes], chunk_blocks: int, block_bytes: int, first_id: int
) -> list[TransferChunk]:
    """Host slot i <-> keys[i], in chunks; the remote side is positions 0..n-1."""
    chunks: list[TransferChunk] = []
    for start in range(0, len(keys), chunk_blocks):
        host_slots = tuple(range(start, min(start + chunk_blocks, len(keys))))
        remote_slots = tuple(range(len(host_slots)))
        writing = direction is Direction.CPU_TO_REMOTE
        chunk = TransferChunk(
            transfer_id=first_id + len(chunks),
            direction=direction,
            priority=Priority.LOW if writing else Priority.HIGH,
            src_slots=host_slots if writing else remote_slots,
            dst_slots=remote_slots if writing else host_slots,
            num_bytes=len(host_slots) * block_bytes,
            keys=tuple(keys[start : start + len(host_slots)]),
        )
        chunks.append(chunk)
    return chunks


def _engine_pass(
    engine: RemoteCopyEngine, keys: list[bytes], chunk_blocks: int
) -> tuple[float, float]:
    """Seconds to write every block, then to read every block back (all chunks
    submitted at once, as the swapper does for a long prefix)."""
    seconds = []
    for index, direction in enumerate((Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU)):
        first_id = index * len(keys) + 1
        chunks = _chunks(direction, keys, chunk_blocks, engine.block_bytes, first_id)
        start_s = time.perf_counter()
        for chunk in chunks:
            engine.submit(chunk)
        results = engine.wait_all()
        seconds.append(time.perf_counter() - start_s)
        failed = [r for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{direction.value}: {len(failed)} chunks failed: {failed[0].error}")
    return seconds[0], seconds[1]


def _plain_pass(url: str, host: HostPool, names: list[bytes]) -> tuple[float, float]:
    """The same bytes with redis-py as a user would call it: SET then GET per block."""
    client = redis.Redis.from_url(url)
    values = [host.byte_view(slot).numpy().tobytes() for slot in range(len(names))]
    start_s = time.perf_counter()
    for name, value in zip(names, values, strict=True):
        client.set(name, value)
    write_s = time.perf_counter() - start_s
    start_s = time.perf_counter()
    for name in names:
        client.get(name)
    read_s = time.perf_counter() - start_s
    client.close()
    return write_s, read_s


def measure_bandwidth(
    url: str,
    *,
    num_blocks: int,
    block_bytes: int,
    chunk_blocks: int,
    repeats: int = 3,
    **engine_options: Any,
) -> dict[str, Any]:
    """Median bytes/s each way for RemoteCopyEngine and plain redis-py on `url`,
    their ratios, and whether every byte came back. Keys are fresh each pass;
    the store is flushed (FLUSHDB) before and after. `engine_options`:
    RemoteCopyEngine's (lanes and batch sizes)."""
    layout = KVLayout.from_block_bytes(block_bytes)
    total_bytes = num_blocks * block_bytes
    rates: dict[str, list[float]] = {
        f"{path}_{direction}": []
        for path in ("engine", "plain")
        for direction in ("cpu_to_remote", "remote_to_cpu")
    }
    with HostPool(layout, num_blocks) as host:
        generator = torch.Generator().manual_seed(0)
        original = torch.randint(
            0, 256, (num_blocks, block_bytes), dtype=torch.uint8, generator=generator
        )
        client = RemoteStoreClient(
            parse_remote_url(url), namespace="kvswap-bench", timeout_ms=10_000.0
        )
        client.connect(required=True)
        engine = RemoteCopyEngine(
            client, host, max_inflight_write_chunks=num_blocks, **engine_options
        )
        plain = redis.Redis.from_url(url)
        plain.flushdb()
        intact = True
        try:
            for repeat in range(repeats):
                for slot in range(num_blocks):
                    host.byte_view(slot).copy_(original[slot])
                keys = [
                    hashlib.sha256(f"{repeat}:{i}".encode()).digest() for i in range(num_blocks)
                ]
                write_s, read_s = _engine_pass(engine, keys, chunk_blocks)
                intact = intact and all(
                    torch.equal(host.byte_view(slot), original[slot]) for slot in range(num_blocks)
                )
                rates["engine_cpu_to_remote"].append(total_bytes / write_s)
                rates["engine_remote_to_cpu"].append(total_bytes / read_s)
                names = [f"plain:{repeat}:{i}".encode() for i in range(num_blocks)]
                write_s, read_s = _plain_pass(url, host, names)
                rates["plain_cpu_to_remote"].append(total_bytes / write_s)
                rates["plain_remote_to_cpu"].append(total_bytes / read_s)
                plain.flushdb()
        finally:
            stats = engine.stats()
            engine.close()
            plain.close()
    report: dict[str, Any] = {
        f"{name}_gb_per_s": statistics.median(values) / 1e9 for name, values in rates.items()
    }
    for direction in ("cpu_to_remote", "remote_to_cpu"):
        report[f"{direction}_ratio"] = (
            report[f"engine_{direction}_gb_per_s"] / report[f"plain_{direction}_gb_per_s"]
        )
    report.update(
        num_blocks=num_blocks, block_bytes=block_bytes, chunk_blocks=chunk_blocks,
        repeats=repeats, every_byte_back=intact, skipped_writes=stats.skipped_writes,
        server=engine.client.server_version, **engine_options,
    )  # fmt: skip
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a store to use (default: a private one)")
    parser.add_argument("--block-bytes", default="1MiB", help="bytes per KV block (1MiB)")
    parser.add_argument("--num-blocks", type=int, default=64, help="blocks per pass (64)")
    parser.add_argument("--chunk-blocks", type=int, default=8, help="blocks per chunk (8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (3)")
    parser.add_argument("--read-lanes", type=int, default=DEFAULT_READ_LANES)
    parser.add_argument("--write-lanes", type=int, default=DEFAULT_WRITE_LANES)
    parser.add_argument("--read-batch-bytes", default=str(READ_BATCH_BYTES))
    parser.add_argument("--write-batch-bytes", default=str(WRITE_BATCH_BYTES))
    args = parser.parse_args(argv)
    args.block_bytes = parse_size_bytes(args.block_bytes, "--block-bytes")
    for name in ("read_batch_bytes", "write_batch_bytes"):
        setattr(args, name, parse_size_bytes(getattr(args, name), f"--{name.replace('_', '-')}"))
    if min(args.num_blocks, args.chunk_blocks, args.repeats) < 1:
        parser.error("--num-blocks, --chunk-blocks and --repeats must be >= 1")
    return args


def _print(report: dict[str, Any]) -> None:
    print(
        f"remote tier, {report['num_blocks']} blocks x {report['block_bytes']} B, chunks of "
        f"{report['chunk_blocks']}, {report['server']}, median of {report['repeats']}"
    )
    print(f"  {'direction':<14} {'RemoteCopyEngine':>17} {'plain redis-py':>15} {'ratio':>6}")
    for direction in ("cpu_to_remote", "remote_to_cpu"):
        ratio = report[f"{direction}_ratio"]
        print(
            f"  {direction:<14} {report[f'engine_{direction}_gb_per_s']:>12.2f} GB/s "
            f"{report[f'plain_{direction}_gb_per_s']:>10.2f} GB/s {ratio:>6.2f}"
            f"{'' if ratio >= GOAL_RATIO else f'  (goal >= {GOAL_RATIO})'}"
        )
    print(f"  every byte came back: {'yes' if report['every_byte_back'] else 'NO'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    options = {
        "num_blocks": args.num_blocks, "block_bytes": args.block_bytes,
        "chunk_blocks": args.chunk_blocks, "repeats": args.repeats,
        "num_read_lanes": args.read_lanes, "num_write_lanes": args.write_lanes,
        "read_batch_bytes": args.read_batch_bytes, "write_batch_bytes": args.write_batch_bytes,
    }  # fmt: skip
    if args.url is not None:
        report = measure_bandwidth(args.url, **options)
    else:
        missing = redis_server_missing()
        if missing is not None:
            raise SystemExit(f"no --url and {missing}")
        with (
            tempfile.TemporaryDirectory(prefix="kvswap-bench-redis-") as work_dir,
            RedisServer(Path(work_dir)).start() as server,
        ):
            report = measure_bandwidth(server.url, **options)
    _print(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
