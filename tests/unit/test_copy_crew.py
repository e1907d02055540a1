"""The CPU path's copy crew: one chunk's blocks spread over several copy threads.

Round trips on every pool layout, scattered slots, one-block chunks and
random permutations; then the priority rule with helpers (a HIGH chunk waits
only for the LOW blocks already in flight, and the helpers come back to the
LOW chunk afterwards); failures; shutdown. Ordering is asserted on events and
thread names, never on timings."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.base.transfer import Direction, TransferChunk
from kvswap.data import block_copy, copy_workers
from kvswap.data.block_copy import Job
from kvswap.data.copy_crew import CopyCrew
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout

from .copy_engine_support import HANG_TIMEOUT_S, NUM_SLOTS, chunk, fill_random, within_timeout

CREW_PREFIX = "kvswap-crew-"

# Every kind of block the pools hold: raw bytes, MHA / GQA / MQA in each KV dtype,
# MLA's single latent plane, an odd byte count.
LAYOUTS = {
    "raw-8KiB": KVLayout.from_block_bytes(8192),
    "raw-odd-words": KVLayout.from_block_bytes(4098),
    "gqa-bf16": KVLayout(2, 2, 16, 4, torch.bfloat16),
    "mha-fp16": KVLayout(3, 4, 8, 2, torch.float16),
    "mqa-fp32": KVLayout(1, 1, 32, 8, torch.float32),
    "gqa-fp8": KVLayout(2, 2, 16, 4, torch.float8_e4m3fn),
    "mla-bf16": KVLayout(2, 1, 72, 4, torch.bfloat16, num_kv_planes=1),
}


def spread_engine(device: DevicePool, host: HostPool, copy_threads: int = 3) -> LocalCopyEngine:
    """Every chunk of two or more blocks spread over `copy_threads` threads."""
    return LocalCopyEngine(device, host, copy_threads=copy_threads, min_spread_bytes=0)


def layout_chunk(
    tid: int, direction: Direction, src: tuple[int, ...], dst: tuple[int, ...], block_bytes: int
) -> TransferChunk:
    return replace(chunk(tid, direction, src, dst), num_bytes=len(src) * block_bytes)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_spread_round_trip_is_exact_for_every_layout(name: str) -> None:
    layout = LAYOUTS[name]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host) as engine:
        fill_random(device.kv.view(-1).view(torch.uint8), seed=11)
        original = device.kv.clone()
        out_src, out_dst = (6, 1, 4, 0, 7, 2), (3, 7, 0, 5, 1, 6)
        single = ((3,), (2,))  # a chunk of one block stays on its lane
        engine.submit(layout_chunk(1, Direction.GPU_TO_CPU, out_src, out_dst, layout.block_bytes))
        engine.submit(layout_chunk(2, Direction.GPU_TO_CPU, *single, layout.block_bytes))
        assert all(r.success for r in within_timeout(engine.wait_all))
        device.kv.zero_()
        engine.submit(layout_chunk(3, Direction.CPU_TO_GPU, out_dst, out_src, layout.block_bytes))
        back = (single[1], single[0])
        engine.submit(layout_chunk(4, Direction.CPU_TO_GPU, *back, layout.block_bytes))
        assert all(r.success for r in within_timeout(engine.wait_all))
    moved = sorted((*out_src, 3))
    assert torch.equal(device.kv[moved].view(torch.uint8), original[moved].view(torch.uint8))
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in moved]
    assert device.kv[untouched].view(torch.uint8).eq(0).all()


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    copy_threads=st.integers(1, 4),
    num_blocks=st.integers(1, NUM_SLOTS),
)
def test_random_permutations_round_trip_through_the_crew(
    data: st.DataObject, copy_threads: int, num_blocks: int
) -> None:
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    slots = st.permutations(range(NUM_SLOTS))
    gpu = tuple(data.draw(slots))[:num_blocks]
    cpu = tuple(data.draw(slots))[:num_blocks]
    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host, copy_threads) as engine:
        fill_random(device.kv.view(torch.uint8), seed=num_blocks)
        original = device.kv.clone()
        engine.submit(chunk(1, Direction.GPU_TO_CPU, gpu, cpu))
        assert within_timeout(lambda: engine.wait(1)).success
        for gpu_slot, cpu_slot in zip(gpu, cpu, strict=True):
            assert torch.equal(host.slots[cpu_slot], original[gpu_slot])
        device.kv.zero_()
        engine.submit(chunk(2, Direction.CPU_TO_GPU, cpu, gpu))
        assert within_timeout(lambda: engine.wait(2)).success
    assert torch.equal(device.kv[list(gpu)], original[list(gpu)])


def test_the_crew_copies_every_pair_exactly_once_over_all_its_threads() -> None:
    crew = CopyCrew(3, min_spread_bytes=0)
    lock = threading.Lock()
    seen: list[tuple[int, str]] = []
    started = threading.Barrier(2, timeout=HANG_TIMEOUT_S)

    def copy(src: int, dst: int) -> None:
        with lock:
            seen.append((src, threading.current_thread().name))
            first_two = len(seen) <= 2
        if first_two:
            started.wait()  # the first two pairs are held until two threads hold one each

    pairs = [(index, 100 + index) for index in range(40)]
    try:
        outcome = within_timeout(lambda: crew.run(pairs, copy, num_bytes=40, yield_to=None))
    finally:
        within_timeout(crew.close)
    assert outcome.failed_dst_slots == () and outcome.errors == ()
    assert sorted(src for src, _name in seen) == list(range(40))
    assert any(name.startswith(CREW_PREFIX) for _src, name in seen)


def test_a_chunk_under_min_spread_bytes_stays_on_its_lane() -> None:
    crew = CopyCrew(2, min_spread_bytes=1 << 20)
    names: list[str] = []
    try:
        crew.run(
            [(0, 0), (1, 1), (2, 2)],
            lambda src, dst: names.append(threading.current_thread().name),
            num_bytes=(1 << 20) - 1,
            yield_to=None,
        )
    finally:
        within_timeout(crew.close)
    assert names == [threading.current_thread().name] * 3


@pytest.mark.parametrize("num_helpers", [0, 2])
def test_a_copy_that_raises_stops_the_batch_and_loses_every_block_not_copied(
    num_helpers: int,
) -> None:
    """Pair 5's copy raises: the batch stops. Pair 5 and every pair not copied are
    reported lost (in chunk order), no copied one is, and the error is reported
    once. On the lane alone the pairs go in order: pairs 0-4 land, pairs 5-11 are
    lost, and no pair after pair 5 is even tried."""
    crew = CopyCrew(num_helpers, min_spread_bytes=0)
    tried: list[int] = []
    copied: set[int] = set()
    lock = threading.Lock()

    def copy(src: int, dst: int) -> None:
        with lock:
            tried.append(src)
        if src == 5:
            raise RuntimeError("boom")
        with lock:
            copied.add(dst)

    pairs = [(index, 10 + index) for index in range(12)]
    try:
        outcome = within_timeout(lambda: crew.run(pairs, copy, num_bytes=12, yield_to=None))
    finally:
        within_timeout(crew.close)
    assert 15 in outcome.failed_dst_slots and 15 not in copied
    assert set(outcome.failed_dst_slots) == {10 + index for index in range(12)} - copied
    assert list(outcome.failed_dst_slots) == sorted(outcome.failed_dst_slots)
    assert outcome.errors == ("RuntimeError: boom",)
    if num_helpers == 0:
        assert tried == [0, 1, 2, 3, 4, 5]
        assert outcome.failed_dst_slots == tuple(range(15, 22))


def test_a_failing_copy_in_a_spread_chunk_fails_only_what_it_did_not_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_copy_block = block_copy.copy_block

    def flaky(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        if src == 4:
            raise RuntimeError("injected")
        real_copy_block(pools, direction, src, dst, **kwargs)

    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host) as engine:
        fill_random(device.kv.view(torch.uint8), seed=12)
        monkeypatch.setattr(block_copy, "copy_block", flaky)
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1, 2, 3, 4, 5, 6, 7), tuple(range(8))))
        result = within_timeout(lambda: engine.wait(1))
        assert not result.success and result.error == "RuntimeError: injected"
        assert 4 in result.failed_dst_slots
        for slot in set(range(NUM_SLOTS)) - set(result.failed_dst_slots):
            assert torch.equal(host.slots[slot], device.kv[slot])
        monkeypatch.setattr(block_copy, "copy_block", real_copy_block)
        engine.submit(chunk(2, Direction.GPU_TO_CPU, (4, 5), (4, 5)))  # the engine lives on
        assert within_timeout(lambda: engine.wait(2)).success
        assert torch.equal(host.slots[4], device.kv[4])


def test_high_waits_only_for_the_low_blocks_in_flight_and_the_helpers_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spread 6-block swap-out (2 copy threads) has its first two blocks in
    flight, one per thread, when a 2-block swap-in arrives. Held there, the
    swap-in's blocks are taken by the HIGH lane and by the helper that left
    the swap-out for it; no further swap-out block starts until the swap-in has
    ended; then the helper comes back and copies swap-out blocks again."""
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_copy_block = block_copy.copy_block
    cond = threading.Condition()
    events: list[tuple[str, Direction, str]] = []  # ("start" | "end", direction, thread)
    release = {Direction.GPU_TO_CPU: threading.Event(), Direction.CPU_TO_GPU: threading.Event()}

    def count(kind: str, direction: Direction, crew_only: bool = False) -> int:
        return sum(
            1
            for event, moved, name in events
            if (event, moved) == (kind, direction)
            and (name.startswith(CREW_PREFIX) or not crew_only)
        )

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        name = threading.current_thread().name
        with cond:
            events.append(("start", direction, name))
            cond.notify_all()
            after_high = count("end", Direction.CPU_TO_GPU) == 2
            if (
                direction is Direction.GPU_TO_CPU
                and after_high
                and not name.startswith(CREW_PREFIX)
            ):
                # The lane's first block after the swap-in waits for a helper's.
                assert cond.wait_for(
                    lambda: count("start", direction, crew_only=True) > 1, HANG_TIMEOUT_S
                )
        assert release[direction].wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)
        with cond:
            events.append(("end", direction, name))
            cond.notify_all()

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    swap_out, swap_in = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host, 2) as engine:
        fill_random(host.slots.view(torch.uint8), seed=13)
        expected = host.slots[[6, 7]].clone()
        try:
            engine.submit(chunk(1, swap_out, (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)))
            with cond:
                assert cond.wait_for(lambda: count("start", swap_out) == 2, HANG_TIMEOUT_S)
            engine.submit(chunk(2, swap_in, (6, 7), (6, 7)))
            release[swap_out].set()
            with cond:  # the helper leaves the swap-out and takes a swap-in block
                assert cond.wait_for(lambda: count("start", swap_in) == 2, HANG_TIMEOUT_S)
        finally:
            release[swap_out].set()
            release[swap_in].set()
        results = {r.transfer_id: r for r in within_timeout(engine.wait_all)}
    assert results[1].success and results[2].success
    assert torch.equal(device.kv[[6, 7]], expected.view(device.kv[[6, 7]].shape))
    out_starts = [i for i, e in enumerate(events) if e[:2] == ("start", swap_out)]
    in_ends = [i for i, e in enumerate(events) if e[:2] == ("end", swap_in)]
    assert len(out_starts) == 6 and len(in_ends) == 2
    assert out_starts[1] < min(in_ends) and max(in_ends) < out_starts[2]
    in_threads = {name for event, moved, name in events if (event, moved) == ("start", swap_in)}
    assert any(name.startswith(CREW_PREFIX) for name in in_threads)
    after = [name for event, moved, name in events[max(in_ends) :] if event == "start"]
    assert any(name.startswith(CREW_PREFIX) for name in after)


def crew_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(CREW_PREFIX)}


def test_close_joins_the_helpers_and_no_helpers_run_off_a_cpu_device() -> None:
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    before = crew_threads()
    with HostPool(layout, NUM_SLOTS) as host:
        engine = LocalCopyEngine(device, host, copy_threads=4)
        helpers = crew_threads() - before
        assert len(helpers) == 3
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1, 2), (0, 1, 2)))
        engine.submit(chunk(2, Direction.CPU_TO_GPU, (3, 4, 5), (3, 4, 5)))
        within_timeout(engine.close)
        assert all(r.success for r in engine.wait_all())
    assert not any(thread.is_alive() for thread in helpers)
    with pytest.raises(ValueError, match="copy_threads"):
        LocalCopyEngine(device, None, copy_threads=0)
    # A device pool elsewhere (here torch's "meta" device): its copies are not
    # host memcpys, so no helpers start.
    with LocalCopyEngine(DevicePool(layout, NUM_SLOTS, device="meta"), None, copy_threads=4):
        assert crew_threads() == before


def test_the_lane_starts_its_next_chunk_while_a_helper_finishes_this_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two 2-block swap-outs, 2 copy threads. The helper's block of chunk 1 is
    held until the lane has started a block of chunk 2: a lane that waited for
    chunk 1's last block before taking chunk 2 would never get there. Chunk 1
    is reported when its last block lands, by the helper: after chunk 2 began."""
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_copy_block = block_copy.copy_block
    cond = threading.Condition()
    started: list[tuple[str, int]] = []  # (thread name, source slot)
    first, second = (0, 1), (2, 3)

    def started_by(crew: bool, slots: tuple[int, ...]) -> bool:
        return any(name.startswith(CREW_PREFIX) == crew and src in slots for name, src in started)

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        on_crew = threading.current_thread().name.startswith(CREW_PREFIX)
        with cond:
            started.append((threading.current_thread().name, src))
            cond.notify_all()
            if src in first and not on_crew:  # the lane waits for the helper to join
                assert cond.wait_for(lambda: started_by(True, first), HANG_TIMEOUT_S)
            if src in first and on_crew:  # the helper's block lands after chunk 2 began
                assert cond.wait_for(lambda: started_by(False, second), HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host, 2) as engine:
        fill_random(device.kv.view(torch.uint8), seed=14)
        engine.submit(chunk(1, Direction.GPU_TO_CPU, first, first))
        engine.submit(chunk(2, Direction.GPU_TO_CPU, second, second))
        results = {r.transfer_id: r for r in within_timeout(engine.wait_all)}
        assert torch.equal(host.slots[:4], device.kv[:4])
    assert results[1].success and results[2].success
    assert results[2].start_s < results[1].end_s  # the two chunks overlapped


def held_first_chunk(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """Hook the block copy: chunk 0's block (source slot 7) waits for `release`, so
    the chunks submitted after it are all queued when the lane comes back."""
    real_copy_block = block_copy.copy_block

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        if src == 7:
            assert release.wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)

    monkeypatch.setattr(block_copy, "copy_block", hooked)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_lane_that_dies_opening_its_next_chunk_leaves_no_chunk_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug kills the LOW lane as it opens chunk 2, right after chunk 1, whose last
    blocks a helper may still be copying. Both are reported: chunk 2 failed;
    chunk 1 with every block not copied marked failed and every other one holding
    its bytes. Nothing hangs."""
    layout = LAYOUTS["raw-8KiB"]
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_start = copy_workers.QueueWorker._start
    release = threading.Event()

    def dying_start(self: copy_workers.QueueWorker, job: Job, lane: Any) -> Any:
        if job.chunk.transfer_id == 2:
            raise RuntimeError("bug in a lane")
        return real_start(self, job, lane)

    held_first_chunk(monkeypatch, release)
    monkeypatch.setattr(copy_workers.QueueWorker, "_start", dying_start)
    with HostPool(layout, NUM_SLOTS) as host, spread_engine(device, host, 2) as engine:
        fill_random(device.kv.view(torch.uint8), seed=16)
        engine.submit(chunk(10, Direction.GPU_TO_CPU, (7,), (7,)))
        engine.submit(chunk(1, Direction.GPU_TO_CPU, (0, 1, 2), (0, 1, 2)))
        engine.submit(chunk(2, Direction.GPU_TO_CPU, (3, 4), (3, 4)))
        release.set()
        results = {r.transfer_id: r for r in within_timeout(engine.wait_all)}
        within_timeout(engine.close)
        assert results[10].success
        assert not results[2].success and results[2].failed_dst_slots == (3, 4)
        assert results[2].error == "copy worker exited (RuntimeError)"
        assert results[1].success == (results[1].failed_dst_slots == ())
        for slot in {0, 1, 2} - set(results[1].failed_dst_slots):
            assert torch.equal(host.slots[slot], device.kv[slot])
