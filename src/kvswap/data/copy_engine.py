"""The real copy engine: executes the control plane's chunks between the pools.

`LocalCopyEngine` implements `kvswap.base.transfer.CopyEngine` between a
device pool and a pinned host pool (the keyed tiers below the pinned pool move
their own bytes: `kvswap.data.tiers`, `kvswap.data.remote_copy`). It decides
nothing: the swapper picks slots, directions and priorities; this engine moves
the bytes and reports, for every chunk, its id, bytes, start/end times (wall
clock, `time.perf_counter` seconds), success and the destination slots that
must not be trusted.

Two queues (see `copy_workers` for how they run):
  HIGH  swap-in CPU_TO_GPU, prefetch  - always goes first, on `prefetch_streams`
        lanes (CUDA streams / CPU threads) in parallel
  LOW   swap-out GPU_TO_CPU           - one lane, yields to HIGH

A result's start_s is when its worker began the chunk (CPU path) or when the
GPU began its first copy (CUDA path); a LOW chunk's duration includes the time
it yielded to HIGH chunks. Byte accounting per direction is left to the caller
(the control plane knows each chunk's direction and gets every result).

All public methods are called from one control thread. Wrong arguments
(slots out of range, a reused id, submit after close) are programming errors
and raise ValueError; copy failures are never raised, they are reported.
"""

from __future__ import annotations

import time

import torch

from kvswap.base.tier import Tier
from kvswap.base.transfer import CopyEngine, Priority, TransferChunk, TransferResult
from kvswap.data.block_copy import GPU_DIRECTIONS, Job, Pools, failed_result
from kvswap.data.copy_crew import CopyCrew
from kvswap.data.copy_workers import QueueWorker
from kvswap.data.device_pool import DevicePool
from kvswap.data.future_results import FutureResults
from kvswap.data.host_pool import HostPool
from kvswap.data.link_arbiter import LinkArbiter
from kvswap.errors import KvSwapError
from kvswap.units import ceil_div

# CPU path: threads sharing one chunk's copies. A host memory bus saturates with
# a few; more only contend with the model's own threads.
MAX_COPY_THREADS = 8
# A chunk smaller than this stays on its lane: waking a helper costs more than
# the bytes it would take over.
MIN_SPREAD_BYTES = 1 << 20
# CPU path: a LOW (swap-out) block is copied in pieces of at most this many bytes,
# so a HIGH chunk waits for a piece per copy thread, not a block. Measured on 2
# shared cores with 1 MiB blocks: 512 KiB pieces took the 4-block swap-in's
# slowdown under a swap-out from 1.24x to 1.08x at no measurable swap-out cost;
# 256 KiB did no better (1.10x) and cost ~5% of the swap-out's rate (each piece
# is ~4 us of Python). On a quiet machine (6 runs each, taking turns) they did not
# help (1.54x against 1.45x whole) and cost ~4% of the swap-out's rate; kept for
# the loaded case, where the engine's copies run beside its model threads.
LOW_PIECE_BYTES = 512 << 10

# More parallel swap-ins than this only add contention: a PCIe link has one or
# two copy engines per direction, and a host memory bus saturates with a few.
MAX_PREFETCH_STREAMS = 8


class LocalCopyEngine(FutureResults[TransferChunk, TransferResult], CopyEngine):
    """Two prioritised copy queues over real pools: CUDA streams + events when the
    device pool is on a GPU, worker threads otherwise.
    The HIGH queue runs on `prefetch_streams` lanes at once. Its lanes complete one
    future per chunk (`FutureResults`)."""

    _id_word = "transfer"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool | None,
        *,
        prefetch_streams: int = 1,
        max_in_flight_high_chunks: int = 4,
        max_in_flight_low_chunks: int = 1,
        copy_threads: int | None = None,
        min_spread_bytes: int = MIN_SPREAD_BYTES,
        low_piece_bytes: int = LOW_PIECE_BYTES,
    ) -> None:
        """`host_pool` None: a GPU-only store (no CPU tier); every chunk is refused.
        `prefetch_streams`: HIGH chunks (swap-in, restore, prefetch) that move at
        once, 1..MAX_PREFETCH_STREAMS (the config's `prefetch_stream_count`).
        `max_in_flight_*_chunks`: CUDA path only, chunks queued on the queue's
        streams at once; HIGH's are shared out over its streams (ceil(n / streams)
        each). LOW stays at 1 so a HIGH chunk never waits behind more than one.
        `copy_threads`: CPU path with the device pool on the CPU, the threads that
        share one chunk's block copies, its lane included (1..MAX_COPY_THREADS;
        None: torch's intra-op thread count, the threads its own memcpy uses);
        chunks under `min_spread_bytes` stay on their lane. `low_piece_bytes`: the
        same path's LOW blocks are copied in pieces of at most that many bytes (0:
        whole blocks), so a HIGH chunk waits for less."""
        super().__init__()
        _check_prefetch_streams(prefetch_streams)
        # Checked here, before any lane's thread starts, so a refusal leaks none.
        for name, depth in (
            ("max_in_flight_high_chunks", max_in_flight_high_chunks),
            ("max_in_flight_low_chunks", max_in_flight_low_chunks),
        ):
            if depth < 1:
                raise ValueError(f"{name} must be >= 1, got {depth}")
        if copy_threads is None:
            copy_threads = min(torch.get_num_threads(), MAX_COPY_THREADS)
        if not 1 <= copy_threads <= MAX_COPY_THREADS:
            raise ValueError(f"copy_threads must be 1..{MAX_COPY_THREADS}, got {copy_threads}")
        if min_spread_bytes < 0:
            raise ValueError(f"min_spread_bytes must be >= 0, got {min_spread_bytes}")
        if low_piece_bytes < 0:
            raise ValueError(f"low_piece_bytes must be >= 0, got {low_piece_bytes}")
        block_bytes = device_pool.layout.block_bytes
        if host_pool is not None and host_pool.layout.block_bytes != block_bytes:
            raise ValueError(
                f"host pool blocks are {host_pool.layout.block_bytes} bytes, "
                f"device pool blocks {block_bytes} bytes; they must match"
            )
        self.block_bytes = block_bytes
        self._pools = Pools(device=device_pool, host=host_pool)
        self._use_cuda = device_pool.is_cuda
        self._arbiter = LinkArbiter()
        self.prefetch_streams = prefetch_streams
        # CUDA: a stream per lane. CPU (and tests without a GPU): None lanes, each a
        # thread that copies itself. The stream path cannot run on the CPU-only
        # development machine; tests/unit/test_copy_engine.py drives its issue/wait
        # order with a fake stream and runs it for real only where CUDA exists.
        high_lanes: list[torch.cuda.Stream | None] = [None] * prefetch_streams
        low_lane: torch.cuda.Stream | None = None
        if self._use_cuda:
            high_streams, low_lane = _make_streams(device_pool.device, prefetch_streams)
            high_lanes = list(high_streams)
        high_depth = ceil_div(max_in_flight_high_chunks, prefetch_streams)
        # Helpers only where the GPU legs are host memcpys: on CUDA they are DMAs on
        # streams, and other devices' copies are not known to be thread-safe.
        on_host = device_pool.device.type == "cpu"
        num_helpers = copy_threads - 1 if on_host else 0
        self._crew = CopyCrew(
            num_helpers,
            min_spread_bytes=min_spread_bytes,
            low_piece_bytes=low_piece_bytes if on_host else 0,  # pieces are numpy row slices
        )
        self._workers = {
            Priority.HIGH: QueueWorker(
                Priority.HIGH, self._pools, self._arbiter, high_lanes, high_depth, self._crew
            ),
            Priority.LOW: QueueWorker(
                Priority.LOW,
                self._pools,
                self._arbiter,
                [low_lane],
                max_in_flight_low_chunks,
                self._crew,
            ),
        }
        self._closed = False

    @property
    def uses_cuda(self) -> bool:
        return self._use_cuda

    def submit(self, chunk: TransferChunk) -> None:
        self._validate(chunk)
        ready_event: torch.cuda.Event | None = None
        if self._use_cuda:
            # Mark "now" on the caller's stream: the copy starts after the kernels
            # that produced (or still read) the device blocks it touches.
            ready_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready_event.record()
        future = self._track(chunk)
        if chunk.priority is Priority.HIGH:
            self._arbiter.high_submitted()  # before the LOW worker's next block check
        self._workers[chunk.priority].put(Job(chunk, future, ready_event))

    def close(self) -> None:
        """Stop accepting chunks, let the queued ones finish, join the workers."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers.values():
            worker.stop()
        for worker in self._workers.values():
            worker.join()
        self._crew.close()

    def __enter__(self) -> LocalCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self) -> list[TransferResult]:
        """Results finished since the last poll/wait, in order of end time; never blocks."""
        return self._done_results()

    def wait(self, transfer_id: int) -> TransferResult:
        """Block until chunk `transfer_id` finishes; its result is not polled again."""
        return self._wait_result(transfer_id)

    def wait_all(self) -> list[TransferResult]:
        """Block until every submitted chunk finishes; return the unreported results."""
        return self._wait_all_results()

    def _id_of(self, job: TransferChunk) -> int:
        return job.transfer_id

    def _lane_alive(self, job: TransferChunk) -> bool:
        return self._workers[job.priority].is_alive()

    def _dead_lane_result(self, job: TransferChunk) -> TransferResult:
        return failed_result(job, time.perf_counter(), "copy worker exited")

    def _validate(self, chunk: TransferChunk) -> None:
        tid = chunk.transfer_id
        if self._closed:
            raise ValueError(f"transfer {tid}: the copy engine is closed")
        if self._is_pending(tid):
            raise ValueError(f"transfer {tid}: id already in use by a pending chunk")
        if not isinstance(chunk.priority, Priority) or chunk.direction not in GPU_DIRECTIONS:
            raise ValueError(
                f"transfer {tid}: bad priority or direction ({chunk.direction!r}); allowed: a "
                "move between the device and host pools (a keyed tier moves its own bytes)"
            )
        if chunk.num_blocks < 1 or len(chunk.dst_slots) != chunk.num_blocks:
            raise ValueError(
                f"transfer {tid}: needs >= 1 block and as many destination as source slots, got "
                f"{len(chunk.src_slots)} -> {len(chunk.dst_slots)}"
            )
        expected_bytes = chunk.num_blocks * self.block_bytes
        if chunk.num_bytes != expected_bytes:
            raise ValueError(
                f"transfer {tid}: num_bytes {chunk.num_bytes} != {chunk.num_blocks} blocks x "
                f"{self.block_bytes} bytes"
            )
        for side, tier, slots in (
            ("source", chunk.direction.src_tier, chunk.src_slots),
            ("destination", chunk.direction.dst_tier, chunk.dst_slots),
        ):
            num_slots = self._num_slots(tier, tid)
            if len(set(slots)) != len(slots):
                raise ValueError(f"transfer {tid}: a {side} slot appears twice in {slots}")
            bad = [slot for slot in slots if not 0 <= slot < num_slots]
            if bad:
                raise ValueError(
                    f"transfer {tid}: {side} {tier.value} slots {bad} out of range [0, {num_slots})"
                )

    def _num_slots(self, tier: Tier, tid: int) -> int:
        if tier is Tier.GPU:
            return self._pools.device.num_blocks
        if self._pools.host is None:  # a CPU direction (the only other tier here)
            raise ValueError(f"transfer {tid}: CPU direction but the engine has no host pool")
        return self._pools.host.num_slots


def _check_prefetch_streams(prefetch_streams: int) -> None:
    valid = isinstance(prefetch_streams, int) and not isinstance(prefetch_streams, bool)
    if not valid or not 1 <= prefetch_streams <= MAX_PREFETCH_STREAMS:
        raise KvSwapError(
            f"copy engine: prefetch_streams {prefetch_streams!r} is invalid; "
            f"expected an integer from 1 to {MAX_PREFETCH_STREAMS}"
        )


def _make_streams(
    device: torch.device, num_high_streams: int
) -> tuple[list[torch.cuda.Stream], torch.cuda.Stream]:
    """`num_high_streams` HIGH streams at the device's highest stream priority and
    one LOW stream at its lowest (CUDA priorities: numerically lower = scheduled
    first). Several HIGH streams let one chunk's launch and DMA setup overlap
    another's data phase, and use a second copy engine where the GPU has one.
    Written for CUDA; not exercised on the CPU-only development machine."""
    priority_range = getattr(torch.cuda.Stream, "priority_range", None)
    # Without the query, out-of-range priorities are clamped to the device's range.
    range_ends = priority_range() if priority_range is not None else (0, -1)
    highest, lowest = min(range_ends), max(range_ends)
    high = [
        torch.cuda.Stream(device=device, priority=highest)  # type: ignore[no-untyped-call]
        for _ in range(num_high_streams)
    ]
    low = torch.cuda.Stream(device=device, priority=lowest)  # type: ignore[no-untyped-call]
    return high, low
