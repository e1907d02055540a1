"""One copy engine shared by both directions vs one per direction, on the virtual clock.

The article's first pitfall: a swap-out chunk on the DMA engine is never preempted,
so a swap-in that arrives meanwhile waits for the whole chunk. That only happens
where both directions queue on ONE engine (`HardwareProfile.shared_copy_engine`).
Every test here uses 2 MB blocks at 25 GB/s and no per-chunk overhead, so a block
takes exactly 80 us of virtual time.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.bench.report import BenchReport, BenchResult
from kvswap.control.policy import named_policy
from kvswap.sim.clock import VirtualClock
from kvswap.sim.copy_model import ModelledCopyEngine
from kvswap.sim.hardware import (
    HardwareProfile,
    copy_engines,
    hardware_from_report,
    hardware_preset,
)
from kvswap.sim.keyed_tier import ModelledKeyedTier
from kvswap.units import MIB

BLOCK_BYTES = 2_000_000
BLOCK_S = BLOCK_BYTES / 25e9  # 80 us


def chunk(tid: int, direction: Direction, priority: Priority, num_blocks: int) -> TransferChunk:
    slots = tuple(range(num_blocks))
    return TransferChunk(tid, direction, priority, slots, slots, num_blocks * BLOCK_BYTES)


def engine(*, shared: bool, nvme_slab: bool = False) -> ModelledCopyEngine:
    """The copy engine on a clock of its own; `nvme_slab`: with an NVMe slab of 1,024
    blocks (by key) below the pinned pool."""
    hw = dataclasses.replace(
        hardware_preset("article-40gb"), transfer_overhead_s=0.0, shared_copy_engine=shared
    )
    clock = VirtualClock()
    policy = named_policy(Tier.NVME, "lru", capacity_blocks=1024)
    slab = ModelledKeyedTier.slab(1024, BLOCK_BYTES, hw, policy)
    keyed = [(slab.store.view(clock), slab.link)] if nvme_slab else []
    return ModelledCopyEngine(hw, clock, prefetch_streams=1, keyed=keyed)


def test_on_a_shared_engine_a_swap_in_waits_for_the_swap_out_chunk_on_the_link() -> None:
    copies = engine(shared=True)
    # t=0: a 512-block swap-out (LOW) takes the idle engine: 512 x 80 us = 40.96 ms.
    copies.submit(chunk(1, Direction.GPU_TO_CPU, Priority.LOW, 512))
    # t=10 ms: a 4-block swap-in (HIGH) arrives; the DMA chunk is not preempted.
    copies.clock.advance(0.010)
    copies.submit(chunk(2, Direction.CPU_TO_GPU, Priority.HIGH, 4))
    swap_in = copies.wait(2)
    assert math.isclose(swap_in.start_s, 512 * BLOCK_S)
    assert math.isclose(swap_in.end_s, 516 * BLOCK_S)
    assert copies.clock.now_s == swap_in.end_s  # the wait is virtual time the caller lost
    # The swap-out chunk is charged with the 30.96 ms it made the swap-in wait.
    low = copies.wait(1)
    assert math.isclose(low.end_s, 512 * BLOCK_S)
    assert copies.high_blocked_by_low_s == [pytest.approx(512 * BLOCK_S - 0.010)]
    assert copies.high_blocked_by_low_s_by_link == {"pcie": [pytest.approx(512 * BLOCK_S - 0.010)]}


def test_on_separate_engines_a_swap_in_never_waits_for_a_swap_out() -> None:
    copies = engine(shared=False)
    copies.submit(chunk(1, Direction.GPU_TO_CPU, Priority.LOW, 512))
    copies.clock.advance(0.010)
    copies.submit(chunk(2, Direction.CPU_TO_GPU, Priority.HIGH, 4))
    swap_in = copies.wait(2)
    assert math.isclose(swap_in.start_s, 0.010)  # its own engine was idle
    assert math.isclose(swap_in.end_s, 0.010 + 4 * BLOCK_S)
    assert copies.wait(1).end_s == pytest.approx(512 * BLOCK_S)  # both ran at once
    assert copies.high_blocked_by_low_s == []
    assert set(copies.busy_s_by_link()) == {"gpu_to_cpu", "cpu_to_gpu"}


def test_high_goes_first_among_the_chunks_waiting_for_a_shared_engine() -> None:
    copies = engine(shared=True)
    copies.submit(chunk(1, Direction.GPU_TO_CPU, Priority.LOW, 8))  # on the engine
    copies.submit(chunk(2, Direction.GPU_TO_CPU, Priority.LOW, 8))  # queued
    copies.submit(chunk(3, Direction.CPU_TO_GPU, Priority.HIGH, 4))  # queued after it
    results = {r.transfer_id: r for r in copies.wait_all()}
    assert math.isclose(results[3].start_s, 8 * BLOCK_S)  # overtakes the queued swap-out
    assert math.isclose(results[2].start_s, 12 * BLOCK_S)
    # Behind an 8-block chunk a swap-in waits 0.64 ms, not 41 ms: the article's fix.
    assert copies.high_blocked_by_low_s == [pytest.approx(8 * BLOCK_S)]


def test_the_nvme_drive_is_its_own_link_whatever_the_copy_engines() -> None:
    for shared in (True, False):
        copies = engine(shared=shared, nvme_slab=True)
        copies.submit(chunk(1, Direction.CPU_TO_NVME, Priority.LOW, 512))  # a demotion
        copies.submit(chunk(2, Direction.CPU_TO_GPU, Priority.HIGH, 4))
        assert copies.wait(2).start_s == 0.0


def test_the_presets_say_which_machines_share_one_copy_engine() -> None:
    assert hardware_preset("article-40gb").shared_copy_engine  # the article's finding
    assert not hardware_preset("h100-pcie5").shared_copy_engine
    assert not hardware_preset("h200").shared_copy_engine
    assert copy_engines(hardware_preset("article-40gb")) == (
        "one copy engine shared by both directions"
    )
    assert copy_engines(hardware_preset("h200")) == "one copy engine per direction"


def bench_report(device: str) -> BenchReport:
    # A CPU report's link is its memcpy rate; a GPU report's, its pinned h2d/d2h rates.
    ops = ("memcpy",) if device == "cpu" else ("h2d", "d2h")
    memory = "mmap" if device == "cpu" else "pinned"
    rows = tuple(
        BenchResult(op, memory, 256 * MIB, 20.0, 20.0, 20.0, 3)  # type: ignore[arg-type]
        for op in ops
    )
    return BenchReport(device, "test", None, rows, 0.0, "2")  # type: ignore[arg-type]


def test_a_bench_profile_takes_its_copy_engines_from_the_report_not_the_base() -> None:
    base: HardwareProfile = hardware_preset("article-40gb")  # shared
    gpu = hardware_from_report(bench_report("cuda"), base, source="gpu.json")
    cpu = hardware_from_report(bench_report("cpu"), hardware_preset("h200"), source="cpu.json")
    assert not gpu.shared_copy_engine and not gpu.low_yields_per_block
    assert cpu.shared_copy_engine and cpu.low_yields_per_block  # host memcpy: one bus


def test_the_option_changes_nothing_else_in_a_profile() -> None:
    # A lone chunk takes the same time either way: only the queueing differs.
    for shared in (True, False):
        copies = engine(shared=shared)
        copies.submit(chunk(1, Direction.CPU_TO_GPU, Priority.HIGH, 10))
        assert copies.wait(1).end_s == pytest.approx(10 * BLOCK_S)
