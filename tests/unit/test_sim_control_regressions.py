"""Control-plane bugs the simulator found at scale, each narrated on a tiny pool."""

from __future__ import annotations

from kvswap.control.policy import PolicyOptions
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.control.transfer import Direction, Tier
from tests.manual_engine import ManualCopyEngine


def test_a_victim_whose_stale_cpu_copy_is_still_being_demoted_stays_on_the_gpu() -> None:
    # Found on a 12k-request trace: AssertionError "block ... already has a cpu copy".
    # 2 GPU slots (swap out from 1 used), 1 CPU slot (demote when full), 4 tokens/block.
    engine = ManualCopyEngine()
    swapper = Swapper(
        StoreLayout(4, 2, 1, 2, 0),
        PolicyOptions(sink_protection=False, min_residency_steps=0),
        SwapSettings(block_bytes=100, swap_out_high_watermark=0.5, swap_out_low_watermark=0.0,
                     swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
                     cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5),
        engine,
        clock_s=lambda: 0.0,
    )  # fmt: skip
    # A sequence with one partial block is preempted (block -> CPU), then resumes
    # (block -> GPU again; its CPU copy stays).
    swapper.open_sequence(1, [1, 2])
    assert swapper.allocate(1, [1, 2])
    swapper.swap_out_sequence(1)
    engine.finish()
    swapper.begin_step(1)
    swapper.set_running(1, True)
    swapper.prefetch([1])
    engine.finish()
    swapper.begin_step(2)
    # The CPU tier is full: its copy starts moving to NVMe (the chunk stays in flight).
    swapper.end_step()
    assert [c.direction for c in engine.pending.values()] == [Direction.CPU_TO_NVME]
    # The block changes (its CPU and NVMe copies go stale but are still in use), fills
    # up, and the sequence ends: the block is now an unreferenced GPU-only candidate.
    assert swapper.allocate(1, [3, 4])
    swapper.finish(1)
    # Over the watermark it is a victim; it must wait for the demotion, not crash.
    swapper.end_step()
    block = next(iter(swapper.store.blocks.values()))
    assert Tier.GPU in block.copies
    swapper.check_integrity()
    engine.finish()
    swapper.begin_step(3)
    swapper.end_step()  # the stale copies are gone: now it can leave
    swapper.check_integrity()
