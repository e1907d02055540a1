"""LocalCopyEngine with several prefetch (HIGH) lanes: parallel swap-ins, still ahead of
every LOW chunk, lanes that die, bad values. Same tiny pools as test_copy_engine.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvswap.base.transfer import Direction
from kvswap.data import block_copy, copy_workers
from kvswap.data.block_copy import Job
from kvswap.data.copy_engine import MAX_PREFETCH_STREAMS, LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.errors import KvSwapError

from .copy_engine_support import (
    HANG_TIMEOUT_S,
    NUM_SLOTS,
    chunk,
    fill_random,
    within_timeout,
)

# --- prefetch streams ----------------------------------------------------------


def copy_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("kvswap-copy-")}


def test_two_prefetch_streams_move_two_high_chunks_at_once(
    pools: tuple[DevicePool, HostPool], monkeypatch: pytest.MonkeyPatch
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

    device, host = pools
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
    pools: tuple[DevicePool, HostPool],
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


def test_parallel_swap_ins_bring_back_every_byte(
    pools: tuple[DevicePool, HostPool],
) -> None:
    """Every device block goes out to a scattered host slot, then comes back in
    four 2-block swap-ins on three lanes: the whole device pool is restored."""
    device, _host = pools
    fill_random(device.kv.view(torch.uint8), seed=6)
    original = device.kv.clone()
    gpu_slots: tuple[int, ...] = (3, 7, 0, 5, 1, 6, 2, 4)
    cpu_slots: tuple[int, ...] = (6, 1, 4, 0, 7, 2, 5, 3)
    with LocalCopyEngine(*pools, prefetch_streams=3) as copy_engine:
        copy_engine.submit(chunk(1, Direction.GPU_TO_CPU, gpu_slots, cpu_slots))
        assert within_timeout(lambda: copy_engine.wait(1)).success
        device.kv.zero_()
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
def test_close_joins_every_lane(pools: tuple[DevicePool, HostPool], prefetch_streams: int) -> None:
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
    pools: tuple[DevicePool, HostPool], bad: Any
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
    pools: tuple[DevicePool, HostPool],
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
