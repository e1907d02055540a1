"""The CPU path's LOW pieces: a swap-out block bigger than `low_piece_bytes` is
copied in pieces, so a HIGH chunk waits for the pieces in flight, not blocks.

Every byte of every block lands exactly once; HIGH blocks stay whole; a piece
that raises loses its block (and what nobody took) and nothing else; a HIGH
chunk arriving mid-block starts before the rest of that block. Ordering is
asserted on events, never on timings."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest
import torch

from kvswap.base.transfer import BUILT_IN_DIRECTIONS, Direction
from kvswap.data import block_copy
from kvswap.data.block_copy import Pools
from kvswap.data.copy_crew import CopyCrew
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

PIECE_BYTES = BLOCK_BYTES // 4


def piece_engine(device: DevicePool, host: HostPool, copy_threads: int = 2) -> LocalCopyEngine:
    return LocalCopyEngine(
        device, host, copy_threads=copy_threads, min_spread_bytes=0, low_piece_bytes=PIECE_BYTES
    )


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_low_blocks_go_in_pieces_covering_every_byte_and_high_blocks_whole(
    monkeypatch: pytest.MonkeyPatch, copy_threads: int
) -> None:
    layout = KVLayout.from_block_bytes(BLOCK_BYTES)
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_copy_block = block_copy.copy_block
    lock = threading.Lock()
    ranges: dict[tuple[Direction, int], list[tuple[int, int] | None]] = defaultdict(list)

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        with lock:
            ranges[(direction, src)].append(kwargs.get("byte_range"))
        real_copy_block(pools, direction, src, dst, **kwargs)

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    out_src, out_dst = (5, 0, 3, 6, 1), (2, 7, 4, 0, 5)
    with HostPool(layout, NUM_SLOTS) as host, piece_engine(device, host, copy_threads) as engine:
        fill_random(device.kv.view(torch.uint8), seed=21)
        original = device.kv.clone()
        engine.submit(chunk(1, Direction.GPU_TO_CPU, out_src, out_dst))
        assert within_timeout(lambda: engine.wait(1)).success
        device.kv.zero_()
        engine.submit(chunk(2, Direction.CPU_TO_GPU, out_dst, out_src))
        assert within_timeout(lambda: engine.wait(2)).success
    assert torch.equal(device.kv[list(out_src)], original[list(out_src)])
    for src in out_src:
        pieces = ranges[(Direction.GPU_TO_CPU, src)]
        assert None not in pieces
        assert sorted(piece for piece in pieces if piece is not None) == [
            (index * PIECE_BYTES, (index + 1) * PIECE_BYTES) for index in range(4)
        ]
    for dst in out_dst:
        assert ranges[(Direction.CPU_TO_GPU, dst)] == [None]  # a swap-in block stays whole


def test_a_piece_that_raises_loses_its_block_and_the_untaken_ones_only() -> None:
    """Pieces of 4 pairs x 3 pieces, one helper; pair 2's second piece raises. The
    batch stops: pair 2 and every pair with a piece nobody took are lost; a pair
    whose 3 pieces all landed is not."""
    crew = CopyCrew(1, min_spread_bytes=0, low_piece_bytes=10)
    lock = threading.Lock()
    landed: dict[int, int] = defaultdict(int)

    def copy_piece(src: int, dst: int, piece: int, num_pieces: int) -> None:
        assert num_pieces == 3
        if (src, piece) == (2, 1):
            raise RuntimeError("boom")
        with lock:
            landed[src] += 1

    def copy(src: int, dst: int) -> None:
        raise AssertionError("whole-block copy in a pieced batch")

    pairs = [(index, 10 + index) for index in range(4)]
    try:
        outcome = within_timeout(
            lambda: crew.run(
                pairs, copy, num_bytes=4 * 30, yield_to=LinkArbiter(), copy_piece=copy_piece
            )
        )
    finally:
        within_timeout(crew.close)
    assert 12 in outcome.failed_dst_slots and outcome.errors == ("RuntimeError: boom",)
    whole = {src for src, count in landed.items() if count == 3}
    assert set(outcome.failed_dst_slots) == {10 + src for src in range(4)} - {
        10 + src for src in whole
    }


def test_the_low_lane_yields_to_a_swap_in_between_pieces_of_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One copy thread per queue. The swap-out lane is in the first piece of a
    1-block swap-out when a swap-in arrives and starts; that piece ends while
    the swap-in is still held: no further piece of the block starts until the
    swap-in has ended, and the block still lands whole."""
    layout = KVLayout.from_block_bytes(BLOCK_BYTES)
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    real_copy_block = block_copy.copy_block
    cond = threading.Condition()
    events: list[tuple[str, Direction]] = []
    release = {Direction.GPU_TO_CPU: threading.Event(), Direction.CPU_TO_GPU: threading.Event()}

    def hooked(pools: Any, direction: Direction, src: int, dst: int, **kwargs: Any) -> None:
        with cond:
            events.append(("start", direction))
            cond.notify_all()
        assert release[direction].wait(HANG_TIMEOUT_S)
        real_copy_block(pools, direction, src, dst, **kwargs)
        with cond:
            events.append(("end", direction))
            cond.notify_all()

    monkeypatch.setattr(block_copy, "copy_block", hooked)
    swap_out, swap_in = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
    with HostPool(layout, NUM_SLOTS) as host, piece_engine(device, host, 1) as engine:
        fill_random(device.kv.view(torch.uint8), seed=22)
        fill_random(host.slots.view(torch.uint8), seed=23)
        low_block = device.kv[0].clone()
        high_block = host.slots[6].clone()
        try:
            engine.submit(chunk(1, swap_out, (0,), (0,)))
            with cond:
                assert cond.wait_for(lambda: ("start", swap_out) in events, HANG_TIMEOUT_S)
            engine.submit(chunk(2, swap_in, (6,), (6,)))
            with cond:
                assert cond.wait_for(lambda: ("start", swap_in) in events, HANG_TIMEOUT_S)
            release[swap_out].set()
            with cond:
                assert cond.wait_for(lambda: ("end", swap_out) in events, HANG_TIMEOUT_S)
        finally:
            release[swap_out].set()
            release[swap_in].set()
        results = within_timeout(engine.wait_all)
        assert all(result.success for result in results)
        assert torch.equal(host.slots[0], low_block)
        assert torch.equal(device.kv[6], high_block)
    low_starts = [i for i, event in enumerate(events) if event == ("start", swap_out)]
    high_end = events.index(("end", swap_in))
    assert len(low_starts) == 4 and low_starts[0] < high_end < low_starts[1]


def test_a_byte_range_is_refused_off_the_host_memcpy_path() -> None:
    """Pieces are numpy row slices: a device pool elsewhere (here torch's "meta"
    device) has no rows to slice, and a range past the block's end is refused."""
    layout = KVLayout.from_block_bytes(BLOCK_BYTES)
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    off_host = DevicePool(layout, NUM_SLOTS, device="meta")
    with HostPool(layout, NUM_SLOTS) as host:
        with pytest.raises(ValueError, match="needs the device pool in host memory"):
            block_copy.copy_block(
                Pools(off_host, host), Direction.GPU_TO_CPU, 0, 0, byte_range=(0, 16)
            )
        with pytest.raises(ValueError, match="out of a"):
            block_copy.copy_block(
                Pools(device, host), Direction.GPU_TO_CPU, 0, 0, byte_range=(0, BLOCK_BYTES + 1)
            )
    with pytest.raises(ValueError, match="low_piece_bytes"):
        LocalCopyEngine(device, None, low_piece_bytes=-1)


@pytest.mark.parametrize(
    "direction", [d for d in BUILT_IN_DIRECTIONS if d.keyed], ids=lambda d: d.value
)
def test_copy_block_refuses_a_keyed_direction(direction: Direction) -> None:
    """A block copy only runs between the device and host pools: a keyed tier's leg
    (the NVMe slab, the remote store), whole or as a piece, is refused and neither
    pool is written."""
    layout = KVLayout.from_block_bytes(BLOCK_BYTES)
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    with HostPool(layout, NUM_SLOTS) as host:
        fill_random(device.kv.view(torch.uint8), seed=24)
        fill_random(host.slots.view(torch.uint8), seed=25)
        device_before, host_before = device.kv.clone(), host.slots.clone()
        pools = Pools(device, host)
        message = f"{direction.value}: not a leg between the device and host pools"
        with pytest.raises(ValueError, match=message):
            block_copy.copy_block(pools, direction, 0, 0)
        with pytest.raises(ValueError, match=message):
            block_copy.copy_block(pools, direction, 0, 0, byte_range=(0, PIECE_BYTES))
        assert torch.equal(device.kv, device_before)
        assert torch.equal(host.slots, host_before)
