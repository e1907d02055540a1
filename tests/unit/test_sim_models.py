"""The simulator's models on their own: clock, links, copy engine, step cost, hardware."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.bench.report import BenchReport, BenchResult
from kvswap.control.scheduler_records import ScheduledSeq
from kvswap.errors import KvSwapError
from kvswap.model.presets import preset_description
from kvswap.sim.clock import VirtualClock
from kvswap.sim.copy_model import ModelledCopyEngine
from kvswap.sim.cost import StepCostModel
from kvswap.sim.hardware import hardware_from_report, hardware_preset
from kvswap.units import MIB

MB = 1_000_000


def chunk(tid: int, direction: Direction, priority: Priority, num_blocks: int) -> TransferChunk:
    slots = tuple(range(num_blocks))
    return TransferChunk(tid, direction, priority, slots, slots, num_blocks * 2 * MB)


def plain_link(*, shared: bool = False, yields: bool = False) -> ModelledCopyEngine:
    """25 GB/s each way, no per-chunk overhead: a 2 MB block takes 80 us."""
    hw = dataclasses.replace(
        hardware_preset("article-40gb"), transfer_overhead_s=0.0, shared_copy_engine=shared,
        low_yields_per_block=yields,
    )  # fmt: skip
    return ModelledCopyEngine(hw, VirtualClock(), prefetch_streams=1)


def test_clock_only_moves_forward() -> None:
    clock = VirtualClock()
    clock.advance(1.5)
    clock.advance_to(1.0)  # the past: ignored
    assert clock() == 1.5
    clock.advance_to(2.0)
    assert clock.now_s == 2.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)


def test_poll_reports_only_chunks_finished_by_now_and_wait_jumps_the_clock() -> None:
    engine = plain_link()
    engine.submit(chunk(1, Direction.CPU_TO_GPU, Priority.HIGH, 10))  # 20 MB: 0.8 ms
    assert engine.poll() == []
    engine.clock.advance(0.0004)
    assert engine.poll() == []
    result = engine.wait(1)
    assert math.isclose(result.end_s, 0.0008) and engine.clock.now_s == result.end_s
    assert engine.poll() == []  # a waited-for result is not reported again


def test_cpu_engine_low_chunks_yield_to_high_between_blocks() -> None:
    engine = plain_link(shared=True, yields=True)
    engine.submit(chunk(1, Direction.GPU_TO_CPU, Priority.LOW, 100))
    engine.clock.advance(0.00005)  # inside the first block (80 us)
    engine.submit(chunk(2, Direction.CPU_TO_GPU, Priority.HIGH, 1))
    assert math.isclose(engine.wait(2).start_s, 0.00008)
    low = engine.wait(1)
    assert math.isclose(low.end_s, 101 * 0.00008)


def test_a_second_prefetch_stream_hides_the_per_chunk_overhead() -> None:
    def finish_s(streams: int) -> float:
        hw = dataclasses.replace(hardware_preset("article-40gb"), transfer_overhead_s=50e-6)
        engine = ModelledCopyEngine(hw, VirtualClock(), prefetch_streams=streams)
        for tid in (1, 2, 3):
            engine.submit(chunk(tid, Direction.CPU_TO_GPU, Priority.HIGH, 4))
        return engine.wait(3).end_s

    data_s = 4 * 2 * MB / 25e9
    assert math.isclose(finish_s(1), 3 * (50e-6 + data_s))
    assert math.isclose(finish_s(2), 50e-6 + 3 * data_s)  # later overheads overlap the data


def test_pageable_memory_is_slower_and_jittered_but_seeded() -> None:
    def durations(pinned: bool, seed: int) -> list[float]:
        hw = hardware_preset("article-40gb")
        engine = ModelledCopyEngine(hw, VirtualClock(), pinned_host=pinned, seed=seed)
        for tid in range(1, 21):
            engine.submit(chunk(tid, Direction.GPU_TO_CPU, Priority.LOW, 8))
        return [r.duration_s for r in sorted(engine.wait_all(), key=lambda r: r.transfer_id)]

    pinned, pageable = durations(True, 0), durations(False, 0)
    assert max(pinned) == pytest.approx(min(pinned))  # float noise only
    assert min(pageable) >= 2 * min(pinned) * 0.99 and len(set(pageable)) == 20
    assert durations(False, 0) == pageable and durations(False, 1) != pageable


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    hw = hardware_preset("article-40gb")
    model = StepCostModel(preset_description("article-8b"), "fp16", hw)
    weights = 8_030_261_248 * 2
    # 8 sequences decoding at 4K context: weights + 8 x 4096 tokens x 128 KiB of KV.
    decode = model.cost(ScheduledSeq(s, (1,), 4095, True) for s in range(8))
    expected_bytes = weights + 8 * 4096 * 131_072
    assert math.isclose(decode.memory_s, expected_bytes / (1555e9 * 0.8))
    assert decode.step_s == pytest.approx(1e-3 + decode.memory_s)
    prefill = model.cost([ScheduledSeq(0, tuple(range(2048)), 0, True)])
    assert prefill.compute_s > prefill.memory_s
    assert prefill.compute_s == pytest.approx(
        (2 * 8_030_261_248 * 2048 + 4 * 32 * 4096 * 2048 * 2049 // 2) / (312e12 * 0.55)
    )


def test_unknown_hardware_lists_the_valid_names() -> None:
    with pytest.raises(KvSwapError, match=r"unknown hardware 'h100'.*h100-pcie5.*"
                       r"valid hardware: article-40gb, h100-pcie5, h200"):  # fmt: skip
        hardware_preset("h100")


def test_a_bench_report_replaces_the_link() -> None:
    def row(op: str, memory: str, gb_per_s: float, num_bytes: int = 256 * MIB) -> BenchResult:
        return BenchResult(op, memory, num_bytes, gb_per_s, gb_per_s, gb_per_s, 3)  # type: ignore[arg-type]

    gather = BenchResult("gather_chunk", "pinned", 8 * 2 * MIB, 10.0, 10.0, 10.0, 3, 0.5, 8,
                         2 * MIB)  # fmt: skip
    report = BenchReport("cuda", "Test GPU", None, (row("h2d", "pinned", 24.0),
                         row("d2h", "pinned", 20.0), row("h2d", "pageable", 12.0), gather),
                         0.0, "2")  # fmt: skip
    hw = hardware_from_report(report, hardware_preset("article-40gb"), source="x.json")
    assert (hw.h2d_gb_per_s, hw.d2h_gb_per_s, hw.pageable_bandwidth_fraction) == (24.0, 20.0, 0.5)
    assert hw.transfer_overhead_s == pytest.approx(16 * MIB / 10e9 - 16 * MIB / 20e9)
    assert not hw.shared_copy_engine and hw.hbm_gb_per_s == 1555.0
