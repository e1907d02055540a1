"""Measure host<->device copy bandwidth and the efficiency of the real swap path.

Rows (GB/s = 1e9 bytes/s; median, min and max over `repeats` timed copies that
follow `NUM_WARMUP_COPIES` untimed ones; every buffer exists before any timing):

    with CUDA      h2d, d2h  x  pinned (PinnedBuffer: exact size, cudaHostRegister)
                                pageable (a plain torch CPU tensor)
    without CUDA   memcpy    x  pageable (torch tensor -> torch tensor)
                                mmap (torch tensor -> PinnedBuffer, not page-locked)
    both           gather_chunk, one row per chunk size

gather_chunk is the swap-out path: `num_blocks` blocks picked at random from a
pool are gathered into one contiguous chunk that lands in the host pool.

    CUDA:  device pool [num_pool_blocks, block_bytes]
             --index_select--> device staging [num_blocks, block_bytes]
             --one D2H copy--> PinnedBuffer view [num_blocks, block_bytes]
    CPU:   host pool [num_pool_blocks, block_bytes]
             --index_select--> PinnedBuffer view [num_blocks, block_bytes]

Its `ratio_to_memcpy` divides its median by the median of a contiguous copy of
the same bytes into the same destination, timed alternately in the same run.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvswap.bench.report import (
    BenchMemory,
    BenchOp,
    BenchReport,
    BenchResult,
    format_result,
)
from kvswap.data.pinned import PinnedBuffer
from kvswap.errors import KvSwapError
from kvswap.host_memory import available_host_bytes
from kvswap.progress import StageProgress as Progress
from kvswap.units import GIB, MIB, format_bytes

MIN_TRANSFER_BYTES = MIB
MAX_TRANSFER_BYTES = GIB
QUICK_TRANSFER_SIZES_BYTES: tuple[int, ...] = (1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
FULL_TRANSFER_SIZES_BYTES: tuple[int, ...] = tuple(MIB << shift for shift in range(11))
NUM_WARMUP_COPIES = 2
CPU_NOTE = (
    "measured on the CPU: every row is a host memory copy (RAM to RAM), not a PCIe "
    "transfer; 'mmap' rows copy into the exact-size pool buffer, not page-locked without CUDA"
)
# A row may use this share of the memory free when it starts; the rest is the OS's.
_MEMORY_BUDGET_FRACTION = 0.8
# The gather pool is several times the largest chunk, so picked blocks are scattered.
_MIN_POOL_BLOCKS = 64
_POOL_BLOCKS_PER_CHUNK_BLOCK = 4
_MIN_TIMED_S = 1e-9  # a copy timed at 0 s (clock resolution) would divide by zero


def transfer_sizes_bytes(*, full: bool = False, max_bytes: int | None = None) -> tuple[int, ...]:
    """The transfer sizes a run measures: a quick subset, or every power of two 1 MiB..1 GiB."""
    sizes = FULL_TRANSFER_SIZES_BYTES if full else QUICK_TRANSFER_SIZES_BYTES
    return tuple(size for size in sizes if max_bytes is None or size <= max_bytes)


def run_bandwidth_bench(
    *,
    full: bool = False,
    block_bytes: int = 2 * MIB,
    chunk_blocks: tuple[int, ...] = (4, 8, 16),
    repeats: int = 5,
    device: str | None = None,
    progress: Progress | None = None,
    max_bytes: int | None = None,
    seed: int = 0,
) -> BenchReport:
    """Measure every row for this machine; `progress` gets one line per row (or skip).

    `device`: None picks CUDA when torch sees it, else the CPU; "cpu", "cuda" or
    "cuda:N" force one. `max_bytes` caps the transfer size (and the gather chunk).
    A row whose buffers would not fit in free memory is skipped, never half-run.
    """
    _validate(full, block_bytes, chunk_blocks, repeats, max_bytes, seed)
    torch_device = _resolve_device(device)
    run = _Run(device=torch_device, repeats=repeats, progress=progress)
    sizes = transfer_sizes_bytes(full=full, max_bytes=max_bytes)
    if torch_device.type == "cuda":
        # A side stream, as the copy engine uses; every timing waits on it.
        copy_stream = torch.cuda.Stream(torch_device)  # type: ignore[no-untyped-call]
        with torch.cuda.device(torch_device), torch.cuda.stream(copy_stream):
            for num_bytes in sizes:
                _cuda_copy_rows(run, num_bytes)
            _gather_rows(run, block_bytes, chunk_blocks, max_bytes, seed)
            device_name = torch.cuda.get_device_name(torch_device)
        note = None
    else:
        for num_bytes in sizes:
            _host_copy_rows(run, num_bytes)
        _gather_rows(run, block_bytes, chunk_blocks, max_bytes, seed)
        device_name = _cpu_name()
        note = CPU_NOTE
    return BenchReport(
        device="cuda" if torch_device.type == "cuda" else "cpu",
        device_name=device_name,
        note=note,
        results=tuple(run.results),
        created_unix_s=time.time(),
        torch_version=str(torch.__version__),
    )


@dataclasses.dataclass
class _Run:
    """State of one benchmark run: where it copies, how it times, what it measured."""

    device: torch.device
    repeats: int
    progress: Progress | None
    results: list[BenchResult] = dataclasses.field(default_factory=list)

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def emit(self, result: BenchResult) -> None:
        self.results.append(result)
        self.say(format_result(result))

    def fits(self, what: str, *, host_bytes: int, device_bytes: int) -> bool:
        """True if the buffers of `what` fit in free memory now; else say it is skipped."""
        free_host_bytes = available_host_bytes()
        if host_bytes > free_host_bytes * _MEMORY_BUDGET_FRACTION:
            self.say(
                f"skipped {what}: needs {format_bytes(host_bytes)} of host memory, "
                f"{format_bytes(free_host_bytes)} available"
            )
            return False
        if device_bytes > 0 and self.device.type == "cuda":
            free_device_bytes, _ = torch.cuda.mem_get_info(self.device)
            if device_bytes > free_device_bytes * _MEMORY_BUDGET_FRACTION:
                self.say(
                    f"skipped {what}: needs {format_bytes(device_bytes)} of device memory, "
                    f"{format_bytes(free_device_bytes)} free"
                )
                return False
        return True

    def time_once(self, copy: Callable[[], object]) -> float:
        """Seconds one call of `copy` takes, the device idle before and after."""
        if self.device.type != "cuda":
            start_ns = time.perf_counter_ns()
            copy()
            return max((time.perf_counter_ns() - start_ns) / 1e9, _MIN_TIMED_S)
        stream = torch.cuda.current_stream(self.device)
        stream.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        copy()
        end.record(stream)
        # The end event, not the host clock: non_blocking copies return before they finish.
        end.synchronize()
        return max(float(start.elapsed_time(end)) / 1e3, _MIN_TIMED_S)

    def measure(self, copy: Callable[[], object]) -> list[float]:
        """Warm-up copies (they also fault pages in), then `repeats` timed ones."""
        for _ in range(NUM_WARMUP_COPIES):
            self.time_once(copy)
        return [self.time_once(copy) for _ in range(self.repeats)]


def _summarise(
    op: BenchOp, memory: BenchMemory, num_bytes: int, seconds: list[float]
) -> BenchResult:
    gb_per_s = sorted(num_bytes / elapsed_s / 1e9 for elapsed_s in seconds)
    return BenchResult(
        op=op,
        memory=memory,
        num_bytes=num_bytes,
        gb_per_s_median=statistics.median(gb_per_s),
        gb_per_s_min=gb_per_s[0],
        gb_per_s_max=gb_per_s[-1],
        num_repeats=len(gb_per_s),
    )


def _memory_label(buffer: PinnedBuffer) -> BenchMemory:
    return "pinned" if buffer.is_pinned else "mmap"


def _host_copy_rows(run: _Run, num_bytes: int) -> None:
    """memcpy rows of a CPU run: tensor -> tensor, then tensor -> PinnedBuffer."""
    if not run.fits(f"memcpy {format_bytes(num_bytes)}", host_bytes=2 * num_bytes, device_bytes=0):
        return
    src = torch.full((num_bytes,), 0x5A, dtype=torch.uint8)  # [num_bytes], pages touched
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    run.emit(_summarise("memcpy", "pageable", num_bytes, run.measure(partial(dst.copy_, src))))
    del dst
    with PinnedBuffer(num_bytes, what="bench host buffer") as buffer:
        seconds = run.measure(partial(buffer.tensor.copy_, src))
        run.emit(_summarise("memcpy", _memory_label(buffer), num_bytes, seconds))


def _cuda_copy_rows(run: _Run, num_bytes: int) -> None:
    """h2d and d2h rows for one size: pinned (PinnedBuffer) first, then pageable."""
    size = format_bytes(num_bytes)
    if not run.fits(f"h2d/d2h {size}", host_bytes=num_bytes, device_bytes=num_bytes):
        return
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=run.device)  # [num_bytes]
    try:
        with PinnedBuffer(num_bytes, what="bench pinned buffer") as buffer:
            host = buffer.tensor
            h2d = partial(on_device.copy_, host, non_blocking=True)
            d2h = partial(host.copy_, on_device, non_blocking=True)
            memory = _memory_label(buffer)
            run.emit(_summarise("h2d", memory, num_bytes, run.measure(h2d)))
            run.emit(_summarise("d2h", memory, num_bytes, run.measure(d2h)))
            del host, h2d, d2h  # drop the views so close() can unmap
    except KvSwapError as exc:
        run.say(f"skipped pinned h2d/d2h {size}: {exc}")
    pageable = torch.full((num_bytes,), 0x5A, dtype=torch.uint8)
    # Pageable copies are staged through a driver buffer; non_blocking would not help.
    run.emit(
        _summarise("h2d", "pageable", num_bytes, run.measure(partial(on_device.copy_, pageable)))
    )
    run.emit(
        _summarise("d2h", "pageable", num_bytes, run.measure(partial(pageable.copy_, on_device)))
    )


def _gather_rows(
    run: _Run, block_bytes: int, chunk_blocks: tuple[int, ...], max_bytes: int | None, seed: int
) -> None:
    """One gather_chunk row per admitted chunk size, each with its contiguous reference."""
    admitted = []
    for num_blocks in chunk_blocks:
        if max_bytes is not None and num_blocks * block_bytes > max_bytes:
            run.say(f"skipped gather_chunk of {num_blocks} blocks: over max_bytes {max_bytes}")
        else:
            admitted.append(num_blocks)
    while admitted:
        max_chunk_blocks = max(admitted)
        num_pool_blocks = max(_MIN_POOL_BLOCKS, _POOL_BLOCKS_PER_CHUNK_BLOCK * max_chunk_blocks)
        pool_bytes = num_pool_blocks * block_bytes
        chunk_bytes = max_chunk_blocks * block_bytes
        on_cuda = run.device.type == "cuda"
        if run.fits(
            f"gather_chunk of {max_chunk_blocks} blocks",
            host_bytes=chunk_bytes if on_cuda else pool_bytes + chunk_bytes,
            device_bytes=pool_bytes + chunk_bytes if on_cuda else 0,
        ):
            break
        admitted.remove(max_chunk_blocks)
    if not admitted:
        return
    generator = torch.Generator().manual_seed(seed)
    # pool: [num_pool_blocks, block_bytes] where the blocks live before swap-out.
    pool = torch.full((num_pool_blocks, block_bytes), 0x5A, dtype=torch.uint8, device=run.device)
    # staging: [max_chunk_blocks, block_bytes] on the device, the gather target on CUDA;
    # on the CPU the gather writes straight into the host pool.
    staging = (
        torch.empty((max_chunk_blocks, block_bytes), dtype=torch.uint8, device=run.device)
        if on_cuda
        else None
    )
    try:
        with PinnedBuffer(chunk_bytes, what="bench pinned chunk") as buffer:
            memory = _memory_label(buffer)
            for num_blocks in sorted(admitted):
                _gather_row(run, pool, staging, buffer.tensor, num_blocks, memory, generator)
    except KvSwapError as exc:
        run.say(f"skipped gather_chunk: {exc}")


def _gather_row(
    run: _Run,
    pool: torch.Tensor,
    staging: torch.Tensor | None,
    host: torch.Tensor,
    num_blocks: int,
    memory: BenchMemory,
    generator: torch.Generator,
) -> None:
    block_bytes = pool.shape[1]
    num_bytes = num_blocks * block_bytes
    # dst: [num_blocks, block_bytes], the chunk's slots at the start of the host buffer.
    dst = host[:num_bytes].view(num_blocks, block_bytes)
    chunk_staging = None if staging is None else staging[:num_blocks]
    gather_s, plain_s = _time_gather(run, pool, chunk_staging, dst, generator)
    gathered = _summarise("gather_chunk", memory, num_bytes, gather_s)
    plain_gb_per_s = statistics.median(num_bytes / elapsed_s / 1e9 for elapsed_s in plain_s)
    run.emit(
        dataclasses.replace(
            gathered,
            ratio_to_memcpy=gathered.gb_per_s_median / plain_gb_per_s,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
        )
    )


def _time_gather(
    run: _Run,
    pool: torch.Tensor,
    staging: torch.Tensor | None,
    dst: torch.Tensor,
    generator: torch.Generator,
) -> tuple[list[float], list[float]]:
    """Alternate gathered and contiguous copies into `dst`; seconds of each, warm-up dropped.

    Every step picks fresh random blocks (and a fresh contiguous range), drawn
    before the clock starts, so neither copy keeps re-reading a cached source.
    """
    num_pool_blocks, num_blocks = pool.shape[0], dst.shape[0]
    on_cuda = staging is not None

    def gather(index: torch.Tensor) -> None:
        if staging is None:
            torch.index_select(pool, 0, index, out=dst)
        else:
            torch.index_select(pool, 0, index, out=staging)
            dst.copy_(staging, non_blocking=True)

    def contiguous(first_block: int) -> None:
        dst.copy_(pool[first_block : first_block + num_blocks], non_blocking=on_cuda)

    gather_s: list[float] = []
    plain_s: list[float] = []
    for step in range(NUM_WARMUP_COPIES + run.repeats):
        # index: [num_blocks] distinct pool rows in random order.
        index = torch.randperm(num_pool_blocks, generator=generator)[:num_blocks].to(pool.device)
        first_block = int(
            torch.randint(num_pool_blocks - num_blocks + 1, (1,), generator=generator)
        )
        gathered = run.time_once(partial(gather, index))
        plain = run.time_once(partial(contiguous, first_block))
        if step >= NUM_WARMUP_COPIES:
            gather_s.append(gathered)
            plain_s.append(plain)
    return gather_s, plain_s


def _validate(
    full: bool,
    block_bytes: int,
    chunk_blocks: tuple[int, ...],
    repeats: int,
    max_bytes: int | None,
    seed: int,
) -> None:
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(full, bool):
        raise KvSwapError(f"full: must be True or False, got {full!r}")
    if not whole(block_bytes) or block_bytes <= 0:
        raise KvSwapError(f"block_bytes: must be a whole number of bytes > 0, got {block_bytes!r}")
    if not isinstance(chunk_blocks, tuple) or not chunk_blocks:
        raise KvSwapError(
            f"chunk_blocks: must be a non-empty tuple of block counts, got {chunk_blocks!r}"
        )
    for num_blocks in chunk_blocks:
        if not whole(num_blocks) or num_blocks <= 0:
            raise KvSwapError(f"chunk_blocks: each must be a whole number >= 1, got {num_blocks!r}")
    if len(set(chunk_blocks)) != len(chunk_blocks):
        raise KvSwapError(f"chunk_blocks: must not repeat a size, got {chunk_blocks!r}")
    if not whole(repeats) or repeats < 1:
        raise KvSwapError(f"repeats: must be a whole number >= 1, got {repeats!r}")
    if max_bytes is not None and (not whole(max_bytes) or max_bytes < MIN_TRANSFER_BYTES):
        raise KvSwapError(
            f"max_bytes: must be a whole number of bytes >= {MIN_TRANSFER_BYTES} (1 MiB, the "
            f"smallest transfer), got {max_bytes!r}"
        )
    if not whole(seed):
        raise KvSwapError(f"seed: must be a whole number, got {seed!r}")


def _resolve_device(device: str | None) -> torch.device:
    allowed = "allowed: cpu, cuda, cuda:N"
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise KvSwapError(f"device: {device!r} is not a device; {allowed}") from exc
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise KvSwapError(f"device: {device!r} cannot be benchmarked; {allowed}")
    if not torch.cuda.is_available():
        raise KvSwapError(f"device: {device!r} asked for but torch sees no CUDA device; use cpu")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise KvSwapError(
            f"device: {device!r} does not exist; this machine has {torch.cuda.device_count()} "
            "CUDA device(s)"
        )
    return torch.device("cuda", index)


def _cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
