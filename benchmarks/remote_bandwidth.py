"""Remote tier vs plain redis-py: bytes/s to and from a Redis store.

Moves `num_blocks` blocks of `block_bytes` from a HostPool to the store and
back through RemoteCopyEngine (`chunk_blocks` per chunk, every value with its
header and CRC-32 checked on the way back), and the same bytes with plain
redis-py (`Redis.from_url(url)`, or `RedisCluster` for a cluster URL, one SET /
GET per block, its default settings); the ratios are engine / plain each way
(goal: >= 0.8 each way).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import redis
import torch
from redis.cluster import ClusterNode

from engine_support import Goal, Result, require
from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import RemoteCopyEngine
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url

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


def plain_client(url: str) -> Any:
    """redis-py as a user opens the store: `Redis.from_url`, or `RedisCluster` over a
    cluster URL's seed nodes."""
    parsed = parse_remote_url(url)
    if not parsed.is_cluster:
        return redis.Redis.from_url(url)
    nodes = [ClusterNode(host, port) for host, port in parsed.cluster_nodes]
    return redis.RedisCluster(
        startup_nodes=nodes, username=parsed.username, password=parsed.password
    )


def _plain_pass(url: str, host: HostPool, names: list[bytes]) -> tuple[float, float]:
    """The same bytes with redis-py as a user would call it: SET then GET per block."""
    client = plain_client(url)
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
        engine = RemoteCopyEngine.over_client(
            client, host, max_inflight_write_chunks=num_blocks, **engine_options
        )
        plain = plain_client(url)
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


#: The figures measure_bandwidth reports; the rest of its report are the shapes.
_FIGURES = (
    "engine_cpu_to_remote_gb_per_s", "plain_cpu_to_remote_gb_per_s", "cpu_to_remote_ratio",
    "engine_remote_to_cpu_gb_per_s", "plain_remote_to_cpu_gb_per_s", "remote_to_cpu_ratio",
    "every_byte_back", "skipped_writes",
)  # fmt: skip


def section_bandwidth(url: str, **options: Any) -> Result:
    """measure_bandwidth as a section: the ratios held to GOAL_RATIO, and a store that
    did not give back every byte, or skipped a write, is a failed section."""
    report = measure_bandwidth(url, **options)
    require(report["every_byte_back"], "the engine did not read back every byte it wrote")
    require(report["skipped_writes"] == 0, f"the store skipped {report['skipped_writes']} writes")
    figures: dict[str, object] = {
        name: round(value, 4) if isinstance(value, float) else value
        for name, value in report.items()
        if name in _FIGURES
    }
    shapes = {name: value for name, value in report.items() if name not in _FIGURES}
    goals = {f"{direction}_ratio": Goal(">=", GOAL_RATIO)
             for direction in ("cpu_to_remote", "remote_to_cpu")}  # fmt: skip
    return Result(shapes, figures, goals)
