"""LocalCopyEngine on tiny pools (8 KiB blocks, 8 slots per tier).

Every test asserts on bytes, ids, ordering and failure reports, never on how
long anything took. Calls that could hang run in a helper thread joined with
a timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.base.tier import Tier
from kvswap.base.transfer import (
    BUILT_IN_DIRECTIONS,
    Direction,
    Priority,
    TransferChunk,
    TransferResult,
)
from kvswap.data import block_copy, copy_workers
from kvswap.data.block_copy import Job, Pools
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.link_arbiter import LinkArbiter

from .copy_engine_support import (
    BLOCK_BYTES,
    HANG_TIMEOUT_S,
    NUM_SLOTS,
    chunk,
    fill_random,
    within_timeout,
)

# --- round trips --------------------------------------------------------------

# The directions this engine moves: the device pool <-> host pool legs. The keyed
# ones (NVMe slab, remote store) move their own bytes and are refused here.
LOCAL_DIRECTIONS = [d for d in BUILT_IN_DIRECTIONS if not d.keyed]
KEYED_DIRECTIONS = [d for d in BUILT_IN_DIRECTIONS if d.keyed]


def test_bytes_round_trip_through_both_legs(
    engine: LocalCopyEngine, pools: tuple[DevicePool, HostPool]
) -> None:
    """Scattered device blocks go out to the host pool in two swap-outs and come
    back in one swap-in: each lands where its chunk says, every other slot stays
    as it was."""
    device, host = pools
    fill_random(device.kv.view(torch.uint8), seed=1)
    original = device.kv.clone()
    gpu_slots, cpu_slots = (5, 0, 7, 2), (3, 6, 1, 4)

    engine.submit(chunk(1, Direction.GPU_TO_CPU, gpu_slots[:2], cpu_slots[:2]))
    engine.submit(chunk(2, Direction.GPU_TO_CPU, gpu_slots[2:], cpu_slots[2:]))
    first = within_timeout(engine.wait_all)
    for gpu_slot, cpu_slot in zip(gpu_slots, cpu_slots, strict=True):
        assert torch.equal(host.slots[cpu_slot], original[gpu_slot])
    device.kv.zero_()
    engine.submit(chunk(3, Direction.CPU_TO_GPU, cpu_slots, gpu_slots))
    last = within_timeout(lambda: engine.wait(3))

    for result in [*first, last]:
        assert result.success, result.error
        assert result.error is None and result.failed_dst_slots == ()
        assert result.duration_s >= 0 and result.start_s <= result.end_s
    assert sorted(r.transfer_id for r in first) == [1, 2]
    assert [r.num_bytes for r in first] == [2 * BLOCK_BYTES] * 2
    assert last.transfer_id == 3 and last.num_bytes == 4 * BLOCK_BYTES
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
    pools: tuple[DevicePool, HostPool],
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
    arbiter = LinkArbiter()
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


# --- faults -------------------------------------------------------------------


def test_a_copy_that_raises_fails_its_chunk_and_the_engine_lives_on(
    engine: LocalCopyEngine,
    pools: tuple[DevicePool, HostPool],
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

    device, host = pools
    host.byte_view(0).fill_(9)
    engine.submit(chunk(3, Direction.CPU_TO_GPU, (0,), (1,)))
    assert within_timeout(lambda: engine.wait(3)).success
    assert device.byte_view(1).eq(9).all()


# --- programming errors and shutdown -------------------------------------------


def test_bad_chunks_are_refused_with_value_errors(
    engine: LocalCopyEngine, pools: tuple[DevicePool, HostPool]
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

    closed = LocalCopyEngine(*pools)
    within_timeout(closed.close)
    with pytest.raises(ValueError, match="closed"):
        closed.submit(chunk(2, Direction.GPU_TO_CPU, (0,), (0,)))


@pytest.mark.parametrize("direction", KEYED_DIRECTIONS, ids=lambda d: d.value)
def test_a_keyed_direction_is_refused_and_leaves_nothing_pending(
    engine: LocalCopyEngine, direction: Direction
) -> None:
    """A chunk to or from a keyed tier (the NVMe slab, the remote store) is not this
    engine's to move: submit refuses it, tracks nothing, and the id stays free."""
    with pytest.raises(ValueError, match=r"allowed: a move between the device and host pools"):
        engine.submit(chunk(1, direction, (0,), (0,)))
    assert engine.num_pending == 0
    engine.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (0,)))
    assert within_timeout(lambda: engine.wait(1)).success


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
    pools: tuple[DevicePool, HostPool],
) -> None:
    """A swap-out (LOW) and a swap-in (HIGH) still queued when close is called both
    finish and are reported; close joins their lanes."""
    device, host = pools
    device.byte_view(0).fill_(5)
    host.byte_view(1).fill_(7)
    copy_engine = LocalCopyEngine(*pools)
    copy_engine.submit(chunk(1, Direction.GPU_TO_CPU, (0,), (0,)))
    copy_engine.submit(chunk(2, Direction.CPU_TO_GPU, (1,), (1,)))
    within_timeout(copy_engine.close)
    within_timeout(copy_engine.close)  # twice is fine
    results = copy_engine.wait_all()
    assert sorted(result.transfer_id for result in results) == [1, 2]
    assert [result.success for result in results] == [True, True]
    assert host.byte_view(0).eq(5).all()
    assert device.byte_view(1).eq(7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_on_streams(layout: KVLayout) -> None:
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


# --- property: any sequence of chunks matches a byte-level model ---------------


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_chunk_sequences_match_a_reference_model(data: st.DataObject) -> None:
    """Chunks of random direction (either leg), priority and slots, each waited for,
    all succeed and leave both pools holding exactly what a plain model of the
    copies says."""
    num_slots, block_bytes = 4, 4096
    layout = KVLayout.from_block_bytes(block_bytes)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    device = DevicePool(layout, num_slots, device="cpu")
    fill_random(device.kv.view(torch.uint8), seed=seed)
    # Per tier and slot: the bytes it must hold.
    model: dict[Tier, list[bytes]] = {
        Tier.GPU: [bytes(device.byte_view(slot).tolist()) for slot in range(num_slots)],
        Tier.CPU: [bytes(block_bytes)] * num_slots,
    }
    with HostPool(layout, num_slots) as host, LocalCopyEngine(device, host) as copy_engine:
        for transfer_id in range(data.draw(st.integers(1, 8), label="num_chunks")):
            direction = data.draw(st.sampled_from(LOCAL_DIRECTIONS))
            num_blocks = data.draw(st.integers(1, num_slots))
            src = tuple(data.draw(st.permutations(range(num_slots)))[:num_blocks])
            dst = tuple(data.draw(st.permutations(range(num_slots)))[:num_blocks])
            priority = data.draw(st.sampled_from(list(Priority)))
            copy_engine.submit(
                TransferChunk(transfer_id, direction, priority, src, dst, num_blocks * block_bytes)
            )
            result = within_timeout(functools.partial(copy_engine.wait, transfer_id))

            assert result.success and result.failed_dst_slots == (), result.error
            src_tier, dst_tier = direction.src_tier, direction.dst_tier
            moved = [model[src_tier][s] for s in src]
            for d, value in zip(dst, moved, strict=True):
                model[dst_tier][d] = value

        for slot in range(num_slots):
            for tier, view in (
                (Tier.GPU, device.byte_view(slot)),
                (Tier.CPU, host.byte_view(slot)),
            ):
                assert bytes(view.tolist()) == model[tier][slot], (tier, slot)
