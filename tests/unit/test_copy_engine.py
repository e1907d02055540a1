"""LocalCopyEngine on tiny pools (8 KiB blocks, 8 slots per tier).

Every test asserts on bytes, ids, ordering and failure reports, never on how
long anything took. Calls that could hang run in a helper thread joined with
a timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import errno
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.control.transfer import Direction, Priority, Tier, TransferChunk, TransferResult
from kvswap.data import block_copy, copy_workers
from kvswap.data.block_copy import Job, Pools
from kvswap.data.copy_engine import MAX_PREFETCH_STREAMS, LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import DiskPool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.errors import KvSwapError

BLOCK_BYTES = 8192
NUM_SLOTS = 8
HANG_TIMEOUT_S = 20.0
T = TypeVar("T")


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_block_bytes(BLOCK_BYTES)


@pytest.fixture
def pools(layout: KVLayout, tmp_path: Path) -> Iterator[tuple[DevicePool, HostPool, DiskPool]]:
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    host = HostPool(layout, NUM_SLOTS)
    disk = DiskPool(tmp_path, BLOCK_BYTES, NUM_SLOTS)
    yield device, host, disk
    disk.close()
    host.close()


@pytest.fixture
def engine(pools: tuple[DevicePool, HostPool, DiskPool]) -> Iterator[LocalCopyEngine]:
    copy_engine = LocalCopyEngine(*pools)
    yield copy_engine
    within_timeout(copy_engine.close)


def chunk(
    transfer_id: int,
    direction: Direction,
    src_slots: tuple[int, ...],
    dst_slots: tuple[int, ...],
    priority: Priority | None = None,
) -> TransferChunk:
    if priority is None:
        swap_in = direction in (Direction.CPU_TO_GPU, Direction.NVME_TO_CPU)
        priority = Priority.HIGH if swap_in else Priority.LOW
    return TransferChunk(
        transfer_id=transfer_id,
        direction=direction,
        priority=priority,
        src_slots=src_slots,
        dst_slots=dst_slots,
        num_bytes=len(src_slots) * BLOCK_BYTES,
    )


def within_timeout(call: Callable[[], T], timeout_s: float = HANG_TIMEOUT_S) -> T:
    """Run `call` in a thread; fail the test if it has not returned in `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"call did not return within {timeout_s} s"
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def fill_random(pool_bytes: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool_bytes.copy_(
        torch.randint(0, 256, pool_bytes.shape, dtype=torch.uint8, generator=generator)
    )


# --- round trips --------------------------------------------------------------


def test_bytes_round_trip_through_every_direction(
    engine: LocalCopyEngine, pools: tuple[DevicePool, HostPool, DiskPool]
) -> None:
    device, host, _disk = pools
    fill_random(device.kv.view(torch.uint8), seed=1)
    original = device.kv.clone()
    gpu_slots, cpu_slots, nvme_slots = (5, 0, 7, 2), (3, 6, 1, 4), (2, 7, 0, 5)

    engine.submit(chunk(1, Direction.GPU_TO_CPU, gpu_slots, cpu_slots))
    engine.submit(chunk(2, Direction.CPU_TO_NVME, cpu_slots, nvme_slots))
    first = within_timeout(engine.wait_all)
    host.slots.zero_()
    device.kv.zero_()
    engine.submit(chunk(3, Direction.NVME_TO_CPU, nvme_slots, cpu_slots))
    restored = within_timeout(lambda: engine.wait(3))
    engine.submit(chunk(4, Direction.CPU_TO_GPU, cpu_slots, gpu_slots))
    last = within_timeout(lambda: engine.wait(4))

    for result in [*first, restored, last]:
        assert result.success, result.error
        assert result.error is None and result.failed_dst_slots == ()
        assert result.num_bytes == 4 * BLOCK_BYTES
        assert result.duration_s >= 0 and result.start_s <= result.end_s
    assert sorted(r.transfer_id for r in first) == [1, 2]
    assert restored.transfer_id == 3 and last.transfer_id == 4
    for slot in gpu_slots:
        assert torch.equal(device.kv[slot], original[slot])
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in gpu_slots]
    assert device.kv[untouched].eq(0).all()


def test_poll_reports_each_result_once_and_wait_takes_it_out(
    engine: LocalCopyEngine,
) -> None:
    engine.submit(chunk(10, Direction.GPU_TO_CPU, (0, 1), (0, 1)))
    engine.submit(chunk(11, Direction.GPU_TO_CPU, (2,), (2,)))
    waited = within_timeout(lambda: engine.wait(11))
    assert waited.transfer_id == 11
    polled: list[TransferResult] = []
    deadline_s = time.monotonic() + HANG_TIMEOUT_S
    while engine.num_pending and time.monotonic() < deadline_s:
        polled.extend(engine.poll())  # never blocks
        time.sleep(0.001)
    assert [result.transfer_id for result in polled] == [10]
    assert engine.poll() == []
    with pytest.raises(ValueError, match="not pending"):
        engine.wait(11)
    with pytest.raises(ValueError, match="not pending"):
        engine.wait(999)


# --- priority -----------------------------------------------------------------


def test_high_chunk_overtakes_a_running_low_chunk(
    engine: LocalCopyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LOW chunk of 6 blocks is copying its first block when a HIGH chunk
    arrives: the HIGH block runs next, the LOW chunk resumes after it."""
    swap_out = Direction.GPU_TO_CPU
    real_copy_block = block_copy.copy_block
    low_started, release_low = threading.Event(), threading.Event()
    events: list[tuple[str, Direction]] = []  # ("start" | "end", direction) per block

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        events.append(("start", direction))
        if direction is Direction.GPU_TO_CPU and not low_started.is_set():
            low_started.set()
            assert release_low.wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)
        events.append(("end", direction))

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)))
    engine.submit(chunk(2, Direction.GPU_TO_CPU, (6,), (6,)))  # a second LOW chunk queued
    assert low_started.wait(HANG_TIMEOUT_S)
    engine.submit(chunk(3, Direction.CPU_TO_GPU, (7,), (7,)))
    release_low.set()
    results = {result.transfer_id: result for result in within_timeout(engine.wait_all)}

    assert all(result.success for result in results.values())
    assert results[3].end_s < results[1].end_s < results[2].end_s
    # The LOW block already in flight is not interrupted; every later LOW block
    # starts only after the HIGH block has ended.
    swap_out_starts = [i for i, event in enumerate(events) if event == ("start", swap_out)]
    swap_in_end = events.index(("end", Direction.CPU_TO_GPU))
    assert len(swap_out_starts) == 7
    assert swap_out_starts[0] < swap_in_end < swap_out_starts[1]


@pytest.mark.parametrize(
    ("max_in_flight", "expected"),
    [
        (3, ["i1", "i2", "i3", "w1", "i4", "w2", "i5", "w3", "w4", "w5"]),
        (1, ["i1", "w1", "i2", "w2", "i3", "w3", "i4", "w4", "i5", "w5"]),
    ],
)
def test_stream_path_keeps_at_most_max_in_flight_chunks_issued(
    pools: tuple[DevicePool, HostPool, DiskPool],
    monkeypatch: pytest.MonkeyPatch,
    max_in_flight: int,
    expected: list[str],
) -> None:
    """The CUDA path's issue/wait order, with a fake stream standing in for CUDA:
    chunks are issued ahead up to the limit and finished oldest first."""
    log: list[str] = []
    all_queued = threading.Event()

    class FakeCudaChunk:
        def __init__(self, job: Job, pools: Pools, stream: object) -> None:
            assert all_queued.wait(HANG_TIMEOUT_S)
            self.job = job
            log.append(f"i{job.chunk.transfer_id}")

        def wait(self) -> TransferResult:
            tid = self.job.chunk.transfer_id
            log.append(f"w{tid}")
            if tid == 4:
                raise RuntimeError("device lost")
            return TransferResult(tid, True, self.job.chunk.num_bytes, 0.0, 1.0)

    monkeypatch.setattr(copy_workers, "CudaChunk", FakeCudaChunk)
    arbiter = copy_workers.LinkArbiter()
    fake_stream: Any = object()
    worker = copy_workers.QueueWorker(
        Priority.HIGH, Pools(*pools), arbiter, [fake_stream], max_in_flight
    )
    jobs = []
    for tid in range(1, 6):
        job = Job(chunk(tid, Direction.CPU_TO_GPU, (tid,), (tid,)), Future(), None)
        arbiter.high_submitted()
        worker.put(job)
        jobs.append(job)
    all_queued.set()
    results = [within_timeout(job.future.result) for job in jobs]
    worker.stop()
    within_timeout(worker.join)
    assert log == expected
    assert [result.success for result in results] == [True, True, True, False, True]
    assert results[3].error == "RuntimeError: device lost"
    assert results[3].failed_dst_slots == (4,)


# --- prefetch streams ----------------------------------------------------------


def copy_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("kvswap-copy-")}


def test_two_prefetch_streams_move_two_high_chunks_at_once(
    pools: tuple[DevicePool, HostPool, DiskPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three swap-in chunks, two streams: every block copy is held at a gate, so
    the first block of chunks 1 and 2 are both in flight before anything ends,
    and chunk 3 waits for a free stream."""
    real_copy_block = block_copy.copy_block
    cond, gate = threading.Condition(), threading.Event()
    started_dst: list[int] = []
    active = {"now": 0, "most": 0}  # block copies in flight

    def gated(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        with cond:
            started_dst.append(dst)
            active["now"] += 1
            active["most"] = max(active["most"], active["now"])
            cond.notify_all()
        assert gate.wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)
        with cond:
            active["now"] -= 1

    device, host, _disk = pools
    fill_random(host.slots.view(torch.uint8), seed=5)
    expected = host.slots.clone()
    monkeypatch.setattr(block_copy, "copy_block", gated)
    with LocalCopyEngine(*pools, prefetch_streams=2) as copy_engine:
        for tid, slots in ((1, (0, 1)), (2, (2, 3)), (3, (4, 5))):
            copy_engine.submit(chunk(tid, Direction.CPU_TO_GPU, slots, slots))
        try:
            with cond:
                assert cond.wait_for(lambda: len(started_dst) == 2, HANG_TIMEOUT_S)
                # Both streams are held at the gate: chunk 3 has not started.
                assert sorted(started_dst) == [0, 2]
        finally:
            gate.set()  # so that a failed check does not leave the lanes waiting
        results = within_timeout(copy_engine.wait_all)
    assert [result.success for result in results] == [True, True, True]
    assert sorted(result.transfer_id for result in results) == [1, 2, 3]
    assert active["most"] == 2
    assert torch.equal(device.kv[:6], expected[:6].view(device.kv[:6].shape))


@pytest.mark.parametrize("prefetch_streams", [1, 2, 4])
def test_every_high_chunk_beats_the_low_blocks_still_to_copy(
    pools: tuple[DevicePool, HostPool, DiskPool],
    monkeypatch: pytest.MonkeyPatch,
    prefetch_streams: int,
) -> None:
    """A 6-block swap-out is copying its first block when three swap-ins arrive:
    with any number of prefetch streams, every later swap-out block starts only
    after the last swap-in block has ended."""
    real_copy_block = block_copy.copy_block
    low_started, release_low = threading.Event(), threading.Event()
    lock = threading.Lock()
    events: list[tuple[str, Direction]] = []

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        with lock:
            events.append(("start", direction))
        if direction is Direction.GPU_TO_CPU and not low_started.is_set():
            low_started.set()
            assert release_low.wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)
        with lock:
            events.append(("end", direction))

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    with LocalCopyEngine(*pools, prefetch_streams=prefetch_streams) as copy_engine:
        copy_engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)))
        assert low_started.wait(HANG_TIMEOUT_S)
        for tid, slots in ((2, (6, 7)), (3, (0, 1)), (4, (2,))):
            copy_engine.submit(chunk(tid, Direction.CPU_TO_GPU, slots, slots))
        release_low.set()
        results = {result.transfer_id: result for result in within_timeout(copy_engine.wait_all)}
    assert all(result.success for result in results.values())
    assert max(results[tid].end_s for tid in (2, 3, 4)) < results[1].end_s
    swap_out_starts = [
        i for i, event in enumerate(events) if event == ("start", Direction.GPU_TO_CPU)
    ]
    swap_in_ends = [i for i, event in enumerate(events) if event == ("end", Direction.CPU_TO_GPU)]
    assert len(swap_out_starts) == 6 and len(swap_in_ends) == 5
    assert swap_out_starts[0] < min(swap_in_ends)
    assert max(swap_in_ends) < swap_out_starts[1]


def test_parallel_swap_ins_and_restores_bring_back_every_byte(
    pools: tuple[DevicePool, HostPool, DiskPool],
) -> None:
    device, host, _disk = pools
    fill_random(device.kv.view(torch.uint8), seed=6)
    original = device.kv.clone()
    gpu_slots, cpu_slots, nvme_slots = (3, 7, 0, 5, 1, 6, 2, 4), (6, 1, 4, 0, 7, 2, 5, 3), (
        5, 2, 7, 0, 3, 6, 1, 4,
    )  # fmt: skip
    with LocalCopyEngine(*pools, prefetch_streams=3) as copy_engine:
        copy_engine.submit(chunk(1, Direction.GPU_TO_CPU, gpu_slots, cpu_slots))
        copy_engine.submit(chunk(2, Direction.CPU_TO_NVME, cpu_slots, nvme_slots))
        assert all(result.success for result in within_timeout(copy_engine.wait_all))
        host.slots.zero_()
        device.kv.zero_()
        for index, start in enumerate(range(0, 8, 2)):  # four restores, in parallel
            pair = slice(start, start + 2)
            copy_engine.submit(
                chunk(10 + index, Direction.NVME_TO_CPU, nvme_slots[pair], cpu_slots[pair])
            )
        assert all(result.success for result in within_timeout(copy_engine.wait_all))
        for index, start in enumerate(range(0, 8, 2)):  # four swap-ins, in parallel
            pair = slice(start, start + 2)
            copy_engine.submit(
                chunk(20 + index, Direction.CPU_TO_GPU, cpu_slots[pair], gpu_slots[pair])
            )
        results = within_timeout(copy_engine.wait_all)
    assert sorted(result.transfer_id for result in results) == [20, 21, 22, 23]
    assert all(result.success and result.failed_dst_slots == () for result in results)
    assert torch.equal(device.kv, original)


@pytest.mark.parametrize("prefetch_streams", [1, 2, MAX_PREFETCH_STREAMS])
def test_close_joins_every_lane(
    pools: tuple[DevicePool, HostPool, DiskPool], prefetch_streams: int
) -> None:
    before = copy_threads()
    copy_engine = LocalCopyEngine(*pools, prefetch_streams=prefetch_streams)
    lanes = copy_threads() - before
    assert len(lanes) == prefetch_streams + 1  # the HIGH lanes and the LOW one
    for tid in range(1, 6):
        copy_engine.submit(chunk(tid, Direction.CPU_TO_GPU, (tid,), (tid,)))
    copy_engine.submit(chunk(6, Direction.GPU_TO_CPU, (0,), (0,)))
    within_timeout(copy_engine.close)
    assert not any(thread.is_alive() for thread in lanes)
    results = copy_engine.wait_all()
    assert sorted(result.transfer_id for result in results) == [1, 2, 3, 4, 5, 6]
    assert all(result.success for result in results)


@pytest.mark.parametrize("bad", [0, -1, MAX_PREFETCH_STREAMS + 1, 2.0, True, "2"])
def test_bad_prefetch_streams_is_a_one_line_error(
    pools: tuple[DevicePool, HostPool, DiskPool], bad: Any
) -> None:
    before = copy_threads()
    with pytest.raises(KvSwapError) as raised:
        LocalCopyEngine(*pools, prefetch_streams=bad)
    message = str(raised.value)
    assert "\n" not in message
    assert "prefetch_streams" in message and repr(bad) in message
    assert f"from 1 to {MAX_PREFETCH_STREAMS}" in message
    assert copy_threads() == before  # refused before any thread started


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("prefetch_streams", [1, 2])
def test_a_dying_lane_fails_its_chunk_and_blocks_nobody(
    pools: tuple[DevicePool, HostPool, DiskPool],
    monkeypatch: pytest.MonkeyPatch,
    prefetch_streams: int,
) -> None:
    """A bug kills the HIGH lane running chunk 1: that chunk is reported failed (no
    hang), the LOW queue does not wait for it forever, and other HIGH lanes, if
    any, keep working; with none left a new HIGH chunk fails at once."""
    real_start = copy_workers.QueueWorker._start

    def dying_start(self: copy_workers.QueueWorker, job: Job, lane: Any) -> Any:
        if job.chunk.transfer_id == 1:
            raise RuntimeError("bug in a lane")
        return real_start(self, job, lane)

    monkeypatch.setattr(copy_workers.QueueWorker, "_start", dying_start)
    with LocalCopyEngine(*pools, prefetch_streams=prefetch_streams) as copy_engine:
        copy_engine.submit(chunk(1, Direction.CPU_TO_GPU, (0, 1), (0, 1)))
        lost = within_timeout(lambda: copy_engine.wait(1))
        assert not lost.success and lost.failed_dst_slots == (0, 1)
        assert lost.error == "copy worker exited (RuntimeError)"
        copy_engine.submit(chunk(2, Direction.CPU_TO_GPU, (2,), (2,)))
        copy_engine.submit(chunk(3, Direction.GPU_TO_CPU, (3,), (3,)))
        results = {result.transfer_id: result for result in within_timeout(copy_engine.wait_all)}
        within_timeout(copy_engine.close)
    assert results[3].success
    assert results[2].success == (prefetch_streams > 1)


# --- faults -------------------------------------------------------------------


def test_enospc_on_one_nvme_write_fails_that_block_only(
    engine: LocalCopyEngine,
    pools: tuple[DevicePool, HostPool, DiskPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _device, host, disk = pools
    fill_random(host.slots.view(torch.uint8), seed=2)
    real_pwritev = os.pwritev
    full_offset = 3 * disk.slot_stride_bytes

    def pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if offset == full_offset:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", pwritev)
    engine.submit(chunk(1, Direction.CPU_TO_NVME, (0, 1, 2), (2, 3, 4)))
    result = within_timeout(lambda: engine.wait(1))
    assert not result.success
    assert result.failed_dst_slots == (3,)
    assert result.error is not None and "ENOSPC" in result.error

    monkeypatch.setattr(os, "pwritev", real_pwritev)
    expected = host.slots.clone()
    host.slots.zero_()
    engine.submit(chunk(2, Direction.NVME_TO_CPU, (2, 4), (0, 2)))
    assert within_timeout(lambda: engine.wait(2)).success
    assert torch.equal(host.slots[[0, 2]], expected[[0, 2]])
    # The slot whose write failed does not read back as good.
    engine.submit(chunk(3, Direction.NVME_TO_CPU, (3,), (1,)))
    lost = within_timeout(lambda: engine.wait(3))
    assert not lost.success and lost.failed_dst_slots == (1,)


def test_corrupted_nvme_slot_is_reported_never_returned_as_good(
    engine: LocalCopyEngine, pools: tuple[DevicePool, HostPool, DiskPool]
) -> None:
    _device, host, disk = pools
    fill_random(host.slots.view(torch.uint8), seed=3)
    expected = host.slots.clone()
    engine.submit(chunk(1, Direction.CPU_TO_NVME, (0, 1, 2), (0, 1, 2)))
    assert within_timeout(lambda: engine.wait(1)).success
    with open(disk.path, "r+b") as slab:
        slab.seek(1 * disk.slot_stride_bytes + 4000)
        value = slab.read(1)[0]
        slab.seek(1 * disk.slot_stride_bytes + 4000)
        slab.write(bytes([value ^ 0x01]))
    host.slots.zero_()
    engine.submit(chunk(2, Direction.NVME_TO_CPU, (0, 1, 2), (5, 6, 7)))
    result = within_timeout(lambda: engine.wait(2))
    assert not result.success
    assert result.failed_dst_slots == (6,)
    assert result.error is not None and "checksum" in result.error
    assert torch.equal(host.slots[5], expected[0])
    assert torch.equal(host.slots[7], expected[2])


def test_a_copy_that_raises_fails_its_chunk_and_the_engine_lives_on(
    engine: LocalCopyEngine,
    pools: tuple[DevicePool, HostPool, DiskPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(block_copy, "copy_block", boom)
        engine.submit(chunk(1, Direction.CPU_TO_GPU, (0, 1), (2, 3)))
        engine.submit(chunk(2, Direction.GPU_TO_CPU, (4,), (4,)))
        failed = {result.transfer_id: result for result in within_timeout(engine.wait_all)}
    assert not failed[1].success and failed[1].failed_dst_slots == (2, 3)
    assert failed[1].error == "RuntimeError: boom"
    assert not failed[2].success and failed[2].failed_dst_slots == (4,)

    device, host, _disk = pools
    host.byte_view(0).fill_(9)
    engine.submit(chunk(3, Direction.CPU_TO_GPU, (0,), (1,)))
    assert within_timeout(lambda: engine.wait(3)).success
    assert device.byte_view(1).eq(9).all()


# --- programming errors and shutdown -------------------------------------------


def test_bad_chunks_are_refused_with_value_errors(
    engine: LocalCopyEngine, pools: tuple[DevicePool, HostPool, DiskPool]
) -> None:
    with pytest.raises(ValueError, match=r"destination cpu slots \[8\] out of range"):
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (8,)))
    with pytest.raises(ValueError, match="source gpu slots"):
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (-1,), (0,)))
    with pytest.raises(ValueError, match="appears twice"):
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 0), (1, 2)))
    with pytest.raises(ValueError, match="as many destination"):
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1), (1,)))
    wrong_bytes = TransferChunk(1, Direction.GPU_TO_CPU, Priority.LOW, (0,), (0,), 1)
    with pytest.raises(ValueError, match="num_bytes"):
        engine.submit(wrong_bytes)
    engine.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (0,)))
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (1,), (1,)))
    within_timeout(engine.wait_all)

    device, host, _disk = pools
    no_disk = LocalCopyEngine(device, host)
    with pytest.raises(ValueError, match="no NVMe pool"):
        no_disk.submit(chunk(1, Direction.CPU_TO_NVME, (0,), (0,)))
    within_timeout(no_disk.close)
    with pytest.raises(ValueError, match="closed"):
        no_disk.submit(chunk(2, Direction.GPU_TO_CPU, (0,), (0,)))


def test_an_engine_without_a_host_pool_refuses_every_chunk(layout: KVLayout) -> None:
    device = DevicePool(layout, 2, device="cpu")
    with LocalCopyEngine(device, None) as gpu_only:
        with pytest.raises(ValueError, match="no host pool"):
            gpu_only.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (0,)))
        assert gpu_only.wait_all() == []


def test_mismatched_pools_are_refused(layout: KVLayout) -> None:
    device = DevicePool(layout, 2, device="cpu")
    with HostPool(KVLayout.from_block_bytes(4096), 2) as host, pytest.raises(ValueError):
        LocalCopyEngine(device, host)


def test_close_finishes_queued_chunks_and_joins(
    pools: tuple[DevicePool, HostPool, DiskPool],
) -> None:
    device, host, _disk = pools
    device.byte_view(0).fill_(5)
    copy_engine = LocalCopyEngine(*pools)
    copy_engine.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (0,)))
    copy_engine.submit(chunk(2, Direction.CPU_TO_NVME, (1,), (1,)))
    within_timeout(copy_engine.close)
    within_timeout(copy_engine.close)  # twice is fine
    results = copy_engine.wait_all()
    assert [result.success for result in results] == [True, True]
    assert host.byte_view(0).eq(5).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_on_streams(layout: KVLayout, tmp_path: Path) -> None:
    device = DevicePool(layout, NUM_SLOTS, device="cuda")
    with HostPool(layout, NUM_SLOTS) as host, LocalCopyEngine(device, host) as copy_engine:
        assert copy_engine.uses_cuda and host.is_pinned
        fill_random(host.slots.view(torch.uint8), seed=4)
        expected = host.slots.clone()
        copy_engine.submit(chunk(1, Direction.CPU_TO_GPU, (0, 1, 2, 3), (7, 5, 3, 1)))
        assert within_timeout(lambda: copy_engine.wait(1)).success
        host.slots.zero_()
        copy_engine.submit(chunk(2, Direction.GPU_TO_CPU, (7, 5, 3, 1), (4, 5, 6, 7)))
        result = within_timeout(lambda: copy_engine.wait(2))
        assert result.success and result.start_s <= result.end_s
        assert torch.equal(host.slots[4:], expected[:4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parallel_swap_ins_on_two_streams(layout: KVLayout) -> None:
    device = DevicePool(layout, NUM_SLOTS, device="cuda")
    with (
        HostPool(layout, NUM_SLOTS) as host,
        LocalCopyEngine(device, host, prefetch_streams=2) as copy_engine,
    ):
        fill_random(host.slots.view(torch.uint8), seed=7)
        expected = host.slots.clone()
        for tid, start in enumerate(range(0, NUM_SLOTS, 2), start=1):
            slots = (start, start + 1)
            copy_engine.submit(chunk(tid, Direction.CPU_TO_GPU, slots, slots[::-1]))
        results = within_timeout(copy_engine.wait_all)
        assert all(result.success for result in results)
        for start in range(0, NUM_SLOTS, 2):
            assert torch.equal(device.byte_view(start + 1).cpu(), expected[start].view(-1))
            assert torch.equal(device.byte_view(start).cpu(), expected[start + 1].view(-1))


# --- property: any sequence of chunks matches a byte-level model ---------------


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_chunk_sequences_match_a_reference_model(data: st.DataObject) -> None:
    """Chunks of random direction, priority and slots, each waited for, leave every
    tier holding exactly what a plain model of the copies says; reading an NVMe
    slot that was never written fails that block and only that block."""
    num_slots, block_bytes = 4, 4096
    layout = KVLayout.from_block_bytes(block_bytes)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    device = DevicePool(layout, num_slots, device="cpu")
    fill_random(device.kv.view(torch.uint8), seed=seed)
    # Per tier and slot: the bytes it must hold, or None where they are unknown.
    model: dict[Tier, list[bytes | None]] = {
        Tier.GPU: [bytes(device.byte_view(slot).tolist()) for slot in range(num_slots)],
        Tier.CPU: [bytes(block_bytes)] * num_slots,
        Tier.NVME: [None] * num_slots,
    }
    nvme_written = [False] * num_slots
    with (
        tempfile.TemporaryDirectory() as directory,
        HostPool(layout, num_slots) as host,
        DiskPool(directory, block_bytes, num_slots) as disk,
        LocalCopyEngine(device, host, disk) as copy_engine,
    ):
        for transfer_id in range(data.draw(st.integers(1, 8), label="num_chunks")):
            direction = data.draw(st.sampled_from(list(Direction)))
            num_blocks = data.draw(st.integers(1, num_slots))
            src = tuple(data.draw(st.permutations(range(num_slots)))[:num_blocks])
            dst = tuple(data.draw(st.permutations(range(num_slots)))[:num_blocks])
            priority = data.draw(st.sampled_from(list(Priority)))
            copy_engine.submit(
                TransferChunk(transfer_id, direction, priority, src, dst, num_blocks * block_bytes)
            )
            result = within_timeout(functools.partial(copy_engine.wait, transfer_id))

            src_tier, dst_tier = direction.src_tier, direction.dst_tier
            expected_failed = tuple(
                d
                for s, d in zip(src, dst, strict=True)
                if src_tier is Tier.NVME and not nvme_written[s]
            )
            assert result.failed_dst_slots == expected_failed
            assert result.success == (not expected_failed)
            moved = [model[src_tier][s] for s in src]
            for d, value in zip(dst, moved, strict=True):
                model[dst_tier][d] = None if d in expected_failed else value
                if dst_tier is Tier.NVME:
                    nvme_written[d] = True

        for slot in range(num_slots):
            for tier, view in (
                (Tier.GPU, device.byte_view(slot)),
                (Tier.CPU, host.byte_view(slot)),
            ):
                if model[tier][slot] is not None:
                    assert bytes(view.tolist()) == model[tier][slot], (tier, slot)
            if nvme_written[slot] and model[Tier.NVME][slot] is not None:
                out = bytearray(block_bytes)
                disk.read_slot(slot, out)
                assert bytes(out) == model[Tier.NVME][slot]
