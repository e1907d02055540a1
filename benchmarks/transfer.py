"""Swap path vs plain copy: throughput and swap-in latency, measured in one run.

Builds a device pool and a pinned host pool, moves `--num-blocks` scattered
blocks (seeded random slot permutations) out and back in through the real
LocalCopyEngine in `--chunk-blocks` chunks, and compares the rate with a plain
contiguous copy of the same bytes between the same two pools. Then measures
one small HIGH swap-in chunk's latency idle and while a long LOW swap-out
stream runs. Then brings back a resuming sequence (`--resume-blocks` blocks in
`--resume-chunk-blocks` HIGH chunks) idle and under a swap-out stream, with 1
and with 2 prefetch streams taking turns on the same pools. Prints a table,
then (last line) one JSON object.

The baseline is the fastest contiguous copy of the same bytes (copy_baselines.py).
It runs as every `kvswap` command does: OMP_WAIT_POLICY=PASSIVE set before
torch loads, unless the caller chose a policy (printed). A program that loads
torch itself keeps its own (GNU OpenMP's default: idle threads spin for a few
milliseconds after every torch op, on the cores the copy threads need).

Each measured section is a function `section_*(bench) -> dict`; add one to
SECTIONS to report more keys.

    .venv/bin/python benchmarks/transfer.py --num-blocks 200 --block-bytes 1MiB
    .venv/bin/python benchmarks/transfer.py --out benchmarks/results/transfer.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvswap.openmp_env import cap_onednn_caches, prefer_passive_openmp_wait

# As the `kvswap` entry point does for every command, before anything loads torch.
prefer_passive_openmp_wait()
cap_onednn_caches()

import numpy as np  # noqa: E402 - after the OpenMP policy is chosen
import torch  # noqa: E402

from copy_baselines import (  # noqa: E402 - a sibling script in benchmarks/
    baseline_report,
    timed_numpy_copy,
    timed_torch_copy,
)
from kvswap.base.transfer import Direction, Priority, TransferChunk, TransferResult  # noqa: E402
from kvswap.data.copy_engine import LocalCopyEngine  # noqa: E402
from kvswap.data.device_pool import DevicePool  # noqa: E402
from kvswap.data.host_pool import HostPool  # noqa: E402
from kvswap.data.layout import KVLayout  # noqa: E402
from kvswap.units import format_bytes, parse_size_bytes  # noqa: E402
from machine import add_out_argument, keep_result  # noqa: E402 - a sibling script in benchmarks/
from policy_cost import section_policy_cost  # noqa: E402 - a sibling script in benchmarks/


@dataclass
class Bench:
    args: argparse.Namespace
    device_pool: DevicePool
    host_pool: HostPool
    engine: LocalCopyEngine
    rng: np.random.Generator
    next_transfer_id: int = 0

    @property
    def block_bytes(self) -> int:
        return self.device_pool.layout.block_bytes

    def new_id(self) -> int:
        self.next_transfer_id += 1
        return self.next_transfer_id

    def sync(self) -> None:
        if self.device_pool.is_cuda:
            torch.cuda.synchronize(self.device_pool.device)


Section = Callable[[Bench], dict[str, Any]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-bytes", default="2MiB", help="bytes per KV block (2MiB)")
    parser.add_argument("--num-blocks", type=int, default=1000, help="blocks per pool (1000)")
    parser.add_argument("--chunk-blocks", type=int, default=8, help="blocks per chunk (8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per section (3)")
    parser.add_argument("--latency-chunk-blocks", type=int, default=4)
    parser.add_argument("--latency-probes", type=int, default=20)
    parser.add_argument("--resume-blocks", type=int, default=16, help="resuming sequence (16)")
    parser.add_argument("--resume-chunk-blocks", type=int, default=4, help="its chunks (4)")
    parser.add_argument("--seed", type=int, default=0)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, help=f"({default_device})")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.block_bytes = parse_size_bytes(args.block_bytes, "--block-bytes")
    if args.num_blocks < args.chunk_blocks + args.latency_chunk_blocks:
        parser.error("--num-blocks must exceed --chunk-blocks + --latency-chunk-blocks")
    if args.num_blocks < args.chunk_blocks + args.resume_blocks:
        parser.error("--num-blocks must exceed --chunk-blocks + --resume-blocks")
    sizes = (args.chunk_blocks, args.latency_chunk_blocks, args.resume_chunk_blocks)
    if min(*sizes, args.resume_blocks, args.repeats, args.latency_probes) < 1:
        parser.error("chunk sizes, --resume-blocks, repeats and probes must be >= 1")
    return args


def build(args: argparse.Namespace) -> Bench:
    layout = KVLayout.from_block_bytes(args.block_bytes)
    device_pool = DevicePool(layout, args.num_blocks, torch.device(args.device))
    host_pool = HostPool(layout, args.num_blocks)
    engine = LocalCopyEngine(device_pool, host_pool, prefetch_streams=1)
    return Bench(args, device_pool, host_pool, engine, np.random.default_rng(args.seed))


def device_bytes(bench: Bench) -> torch.Tensor:
    return bench.device_pool.kv.view(bench.args.num_blocks, -1).view(torch.uint8)


def host_bytes(bench: Bench) -> torch.Tensor:
    return bench.host_pool.slots.view(bench.args.num_blocks, -1).view(torch.uint8)


def fill_blocks(bench: Bench) -> None:
    """Every block distinct: a random template, its slot id in the first 8 bytes
    and a random word in the next 8, so a misplaced block cannot go unnoticed."""
    blocks = device_bytes(bench)  # [num_blocks, block_bytes]
    generator = torch.Generator().manual_seed(bench.args.seed)
    template = torch.randint(0, 256, (bench.block_bytes,), dtype=torch.uint8, generator=generator)
    blocks.copy_(template.to(blocks.device).expand_as(blocks))
    if bench.block_bytes >= 16:
        num_blocks = bench.args.num_blocks
        ids = torch.arange(num_blocks, dtype=torch.int64)
        words = torch.randint(-(2**62), 2**62, (num_blocks,), generator=generator)
        header = torch.stack([ids, words], dim=1).view(torch.uint8)  # [num_blocks, 16]
        blocks[:, :16].copy_(header.to(blocks.device))
    bench.sync()


def block_digests(blocks: torch.Tensor) -> list[int]:
    """Per-block checksum. blocks: [num_blocks, block_bytes] uint8.
    CPU: CRC-32 of each block. CUDA: sum of the block's bytes times random
    position weights, mod 2**64, computed on the GPU a few blocks at a time."""
    if not blocks.is_cuda:
        return [zlib.crc32(blocks[index].numpy().data) for index in range(blocks.shape[0])]
    generator = torch.Generator().manual_seed(1234)
    weights = torch.randint(1, 2**31, (blocks.shape[1],), generator=generator).to(blocks.device)
    batch_blocks = 64
    digests = [
        (blocks[start : start + batch_blocks].to(torch.int64) * weights).sum(dim=1)
        for start in range(0, blocks.shape[0], batch_blocks)
    ]
    return [int(value) for value in torch.cat(digests).tolist()]


def make_chunks(
    bench: Bench,
    direction: Direction,
    priority: Priority,
    src_slots: np.ndarray,
    dst_slots: np.ndarray,
    chunk_blocks: int,
) -> list[TransferChunk]:
    chunks = []
    for start in range(0, len(src_slots), chunk_blocks):
        src = tuple(int(slot) for slot in src_slots[start : start + chunk_blocks])
        dst = tuple(int(slot) for slot in dst_slots[start : start + chunk_blocks])
        chunks.append(
            TransferChunk(
                bench.new_id(), direction, priority, src, dst, len(src) * bench.block_bytes
            )
        )
    return chunks


def run_chunks(bench: Bench, chunks: list[TransferChunk]) -> float:
    """Submit all, wait for all; elapsed wall seconds. Any failure aborts the run."""
    start_s = time.perf_counter()
    for chunk in chunks:
        bench.engine.submit(chunk)
    results = bench.engine.wait_all()
    elapsed_s = time.perf_counter() - start_s
    check_results(results)
    return elapsed_s


def check_results(results: list[TransferResult]) -> None:
    failed = [result for result in results if not result.success]
    if failed:
        raise SystemExit(f"transfer {failed[0].transfer_id} failed: {failed[0].error}")


def gb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


# --- sections ----------------------------------------------------------------


def section_throughput(bench: Bench) -> dict[str, Any]:
    """Every block out (LOW) to scattered host slots, then back in (HIGH), and the
    contiguous copies of the whole pool each way (torch's `copy_`, and one numpy
    memcpy where the device pool is host memory), interleaved in each repeat so
    all see the same machine. Every swap-in is checked block by block."""
    num_blocks, chunk_blocks = bench.args.num_blocks, bench.args.chunk_blocks
    dev, host = device_bytes(bench), host_bytes(bench)
    dev_rows = bench.device_pool.host_byte_rows()  # None on a GPU
    host_rows = bench.host_pool.byte_rows()
    total_bytes = num_blocks * bench.block_bytes
    fill_blocks(bench)
    expected = block_digests(dev)
    times: dict[str, list[float]] = {
        "memcpy_out": [],
        "numpy_out": [],
        "swap_out": [],
        "memcpy_in": [],
        "numpy_in": [],
        "swap_in": [],
    }
    verified = True
    for _ in range(bench.args.repeats):
        device_slots = bench.rng.permutation(num_blocks)
        host_slots = bench.rng.permutation(num_blocks)
        times["memcpy_out"].append(timed_torch_copy(host, dev, bench.sync))
        if dev_rows is not None:
            times["numpy_out"].append(timed_numpy_copy(host_rows, dev_rows))
        swap_out = make_chunks(
            bench, Direction.GPU_TO_CPU, Priority.LOW, device_slots, host_slots, chunk_blocks
        )
        times["swap_out"].append(run_chunks(bench, swap_out))
        times["memcpy_in"].append(timed_torch_copy(dev, host, bench.sync))  # a permutation
        if dev_rows is not None:
            times["numpy_in"].append(timed_numpy_copy(dev_rows, host_rows))
        dev.zero_()  # so the swap-in must bring every byte back
        bench.sync()
        swap_in = make_chunks(
            bench, Direction.CPU_TO_GPU, Priority.HIGH, host_slots, device_slots, chunk_blocks
        )
        times["swap_in"].append(run_chunks(bench, swap_in))
        verified &= block_digests(dev) == expected
    rates = {
        name: gb_per_s(total_bytes, statistics.median(values))
        for name, values in times.items()
        if values
    }
    return baseline_report(rates) | {
        "swap_out_gb_per_s": rates["swap_out"],
        "swap_in_gb_per_s": rates["swap_in"],
        "round_trip_verified": verified,
    }


def section_swap_in_latency(bench: Bench) -> dict[str, Any]:
    """One small HIGH swap-in chunk, submit to completion: idle, then during a
    swap-out stream on the other slots. Only probes that ended while the stream
    was still running count."""
    args = bench.args
    probe_blocks = args.latency_chunk_blocks
    probe_slots = np.arange(args.num_blocks - probe_blocks, args.num_blocks)
    stream_blocks = args.num_blocks - probe_blocks

    def probe() -> tuple[float, float, float]:
        (chunk,) = make_chunks(
            bench, Direction.CPU_TO_GPU, Priority.HIGH, probe_slots, probe_slots, probe_blocks
        )
        start_s = time.perf_counter()
        bench.engine.submit(chunk)
        result = bench.engine.wait(chunk.transfer_id)
        end_s = time.perf_counter()
        check_results([result])
        return start_s, end_s, end_s - start_s

    probe()  # warm-up
    idle_s = statistics.median(probe()[2] for _ in range(args.latency_probes))

    # A stream long enough for all probes, from the measured swap-out rate.
    pass_s = run_chunks(bench, stream_chunks(bench, stream_blocks))
    needed_s = args.latency_probes * (3 * idle_s + 0.002)
    num_passes = min(200, max(2, math.ceil(2 * needed_s / pass_s)))
    stream = [c for _ in range(num_passes) for c in stream_chunks(bench, stream_blocks)]
    for chunk in stream:
        bench.engine.submit(chunk)
    probes: list[tuple[float, float, float]] = []
    results: list[TransferResult] = []
    while len(probes) < args.latency_probes and bench.engine.num_pending > 0:
        probes.append(probe())
        results.extend(bench.engine.poll())
        time.sleep(0.001)  # let the stream run between probes
    results.extend(bench.engine.wait_all())
    check_results(results)
    stream_start_s = min(result.start_s for result in results)
    stream_end_s = max(result.end_s for result in results)
    busy = [lat for start, end, lat in probes if start >= stream_start_s and end <= stream_end_s]
    busy_s = statistics.median(busy) if busy else None
    return {
        "swap_in_latency_idle_ms": idle_s * 1e3,
        "swap_in_latency_under_swap_out_ms": None if busy_s is None else busy_s * 1e3,
        "swap_in_latency_ratio_under_swap_out": None if busy_s is None else busy_s / idle_s,
        "latency_probes_under_swap_out": len(busy),
        "latency_chunk_blocks": probe_blocks,
    }


def stream_chunks(bench: Bench, num_blocks: int) -> list[TransferChunk]:
    device_slots = bench.rng.permutation(num_blocks)
    host_slots = bench.rng.permutation(num_blocks)
    return make_chunks(
        bench, Direction.GPU_TO_CPU, Priority.LOW, device_slots, host_slots, bench.args.chunk_blocks
    )


def section_prefetch_streams(bench: Bench) -> dict[str, Any]:
    """A resuming sequence, submit of its first chunk to completion of its last,
    with 1 and with 2 prefetch streams: idle (the engines alternate probe by
    probe), then under a swap-out stream on the other slots (each engine runs
    its own stream and probes; which goes first alternates per repeat). Every
    probe's blocks are checked against their host copies."""
    args = bench.args
    fill_random_host(bench)
    with LocalCopyEngine(bench.device_pool, bench.host_pool, prefetch_streams=2) as two:
        engines = {1: bench.engine, 2: two}  # the same pools; they take turns
        probe = ResumeProbe(bench)
        for engine in engines.values():
            probe.run(engine)  # warm-up: first touch of the slots, thread start-up
        idle: dict[int, list[float]] = {1: [], 2: []}
        for index in range(args.latency_probes):
            for streams in (1, 2) if index % 2 == 0 else (2, 1):
                idle[streams].append(probe.run(engines[streams])[2])
        idle_s = {streams: statistics.median(values) for streams, values in idle.items()}
        # Swap-out passes per busy phase: long enough for every probe, twice over.
        pass_s = run_chunks(bench, stream_chunks(bench, probe.first_slot))
        needed_s = args.latency_probes * (3 * max(idle_s.values()) + 0.002)
        num_passes = min(200, max(2, math.ceil(2 * needed_s / pass_s)))
        busy: dict[int, list[float]] = {1: [], 2: []}
        for repeat in range(args.repeats):
            for streams in (1, 2) if repeat % 2 == 0 else (2, 1):
                busy[streams] += busy_resume_latencies(probe, engines[streams], num_passes)
    one, two_s = (statistics.median(busy[s]) if busy[s] else None for s in (1, 2))
    return {
        "resume_blocks": args.resume_blocks,
        "resume_chunk_blocks": args.resume_chunk_blocks,
        "resume_idle_1_stream_ms": idle_s[1] * 1e3,
        "resume_idle_2_streams_ms": idle_s[2] * 1e3,
        "resume_idle_2_vs_1_streams": idle_s[2] / idle_s[1],
        "resume_under_swap_out_1_stream_ms": None if one is None else one * 1e3,
        "resume_under_swap_out_2_streams_ms": None if two_s is None else two_s * 1e3,
        "resume_under_swap_out_2_vs_1_streams": (
            None if one is None or two_s is None else two_s / one
        ),
        "resume_probes_under_swap_out": min(len(busy[1]), len(busy[2])),
        "resume_verified": probe.verified,
    }


class ResumeProbe:
    """Brings the last `--resume-blocks` device slots back from scattered host
    slots in `--resume-chunk-blocks` HIGH chunks, all submitted at once."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.first_slot = bench.args.num_blocks - bench.args.resume_blocks
        self.slots = np.arange(self.first_slot, bench.args.num_blocks)
        self.verified = True

    def run(self, engine: LocalCopyEngine) -> tuple[float, float, float]:
        """(start, end, latency) seconds of one resume; its blocks are checked."""
        bench = self.bench
        src = bench.rng.permutation(self.slots)
        chunks = make_chunks(
            bench, Direction.CPU_TO_GPU, Priority.HIGH, src, self.slots,
            bench.args.resume_chunk_blocks,
        )  # fmt: skip
        resumed = device_bytes(bench)[self.first_slot :]
        resumed.zero_()
        bench.sync()
        start_s = time.perf_counter()
        for chunk in chunks:
            engine.submit(chunk)
        results = [engine.wait(chunk.transfer_id) for chunk in chunks]
        end_s = time.perf_counter()
        check_results(results)
        sources = host_bytes(bench)[torch.as_tensor(src)]
        self.verified &= block_digests(resumed) == block_digests(sources)
        return start_s, end_s, end_s - start_s


def busy_resume_latencies(
    probe: ResumeProbe, engine: LocalCopyEngine, num_passes: int
) -> list[float]:
    """Resume latencies while `num_passes` swap-out passes run on `engine`; only
    probes that began and ended while the swap-out was running count."""
    stream = [c for _ in range(num_passes) for c in stream_chunks(probe.bench, probe.first_slot)]
    stream_ids = {chunk.transfer_id for chunk in stream}
    for chunk in stream:
        engine.submit(chunk)
    probes: list[tuple[float, float, float]] = []
    results: list[TransferResult] = []
    while len(probes) < probe.bench.args.latency_probes and engine.num_pending > 0:
        probes.append(probe.run(engine))
        results.extend(engine.poll())
        time.sleep(0.001)  # let the stream run between probes
    results.extend(engine.wait_all())
    check_results(results)
    low = [result for result in results if result.transfer_id in stream_ids]
    low_start_s, low_end_s = min(r.start_s for r in low), max(r.end_s for r in low)
    return [lat for start, end, lat in probes if start >= low_start_s and end <= low_end_s]


def fill_random_host(bench: Bench) -> None:
    """Distinct bytes in every host slot, so a misplaced resume block shows."""
    generator = torch.Generator().manual_seed(bench.args.seed + 1)
    host = host_bytes(bench)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=generator))


SECTIONS: list[Section] = [
    section_throughput,
    section_swap_in_latency,
    section_prefetch_streams,
]


def derive_ratios(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "swap_out_vs_memcpy": report["swap_out_gb_per_s"] / report["memcpy_out_gb_per_s"],
        "swap_in_vs_memcpy": report["swap_in_gb_per_s"] / report["memcpy_in_gb_per_s"],
        "swap_out_vs_fastest_copy": (
            report["swap_out_gb_per_s"] / report["fastest_copy_out_gb_per_s"]
        ),
        "swap_in_vs_fastest_copy": report["swap_in_gb_per_s"] / report["fastest_copy_in_gb_per_s"],
    }


def describe_device(bench: Bench) -> str:
    if bench.device_pool.is_cuda:
        return f"cuda:{torch.cuda.get_device_name(bench.device_pool.device)}"
    return "cpu"


def print_table(report: dict[str, Any]) -> None:
    width = max(len(key) for key in report)
    for key, value in report.items():
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {text}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    bench = build(args)
    try:
        report: dict[str, Any] = {
            "device": describe_device(bench),
            "block_bytes": bench.block_bytes,
            "chunk_blocks": args.chunk_blocks,
            "num_blocks": args.num_blocks,
            "host_pool_pinned": bench.host_pool.is_pinned,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(runtime default)"),
        }
        pool_bytes = bench.host_pool.configured_bytes
        print(
            f"kvswap transfer benchmark: {args.num_blocks} blocks x "
            f"{format_bytes(bench.block_bytes)} = {format_bytes(pool_bytes)} per pool, "
            f"chunks of {args.chunk_blocks} ({format_bytes(args.chunk_blocks * bench.block_bytes)})"
        )
        if not bench.device_pool.is_cuda:
            print("  no GPU: the device pool is host memory, so every rate is a host memcpy rate")
        print(
            f"  OMP_WAIT_POLICY={report['omp_wait_policy']} (what every `kvswap` command runs "
            "with unless the caller chose a policy)"
        )
        for section in SECTIONS:
            report.update(section(bench))
        report.update(section_policy_cost())
        report.update(derive_ratios(report))
        verified = report["round_trip_verified"] and report["resume_verified"]
        verdict = "verified" if verified else "MISMATCH"
        print(f"  round trip and resumes of every block (per-block checksums): {verdict}")
        print_table(report)
        print(json.dumps(report))
        keep_result(args.out, "transfer", "transfer.py", argv, report)
        if not verified:
            raise SystemExit("a round trip or a resume corrupted bytes")
        return report
    finally:
        bench.engine.close()
        bench.host_pool.close()


if __name__ == "__main__":
    main()
