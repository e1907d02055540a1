"""Control-plane bugs the simulator found at scale, each narrated on a tiny pool."""

from __future__ import annotations

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction
from kvswap.control.policy import PolicyOptions
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from tests.manual_engine import ManualCopyEngine
from tests.unit.test_eviction_policies import FifoPolicy


def make(options: PolicyOptions) -> tuple[ManualCopyEngine, Swapper]:
    """2 GPU slots (swap out from 1 used), 1 CPU slot, 4 tokens per block."""
    engine = ManualCopyEngine()
    swapper = Swapper(
        StoreLayout(4, 2, 1, 0),
        options,
        SwapSettings(block_bytes=100, swap_out_high_watermark=0.5, swap_out_low_watermark=0.0,
                     swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
                     cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5),
        engine,
        clock_s=lambda: 0.0,
    )  # fmt: skip
    return engine, swapper


def block_being_swapped_out(options: PolicyOptions) -> tuple[ManualCopyEngine, Swapper]:
    """A sequence with one partial block pauses past the GPU's watermark: its block
    starts moving to the CPU, and the chunk stays in flight."""
    engine, swapper = make(options)
    swapper.open_sequence(1, [1, 2])
    assert swapper.allocate(1, [1, 2])
    swapper.set_running(1, False)
    swapper.end_step()
    assert [c.direction for c in engine.pending.values()] == [Direction.GPU_TO_CPU]
    return engine, swapper


def test_a_victim_whose_stale_cpu_copy_is_still_being_written_stays_on_the_gpu() -> None:
    # Found on a 12k-request trace: AssertionError "block ... already has a cpu copy".
    engine, swapper = block_being_swapped_out(
        PolicyOptions(sink_protection=False, min_residency_steps=0)
    )
    # The sequence resumes and the block changes (its CPU copy, still being written,
    # goes stale), fills up, and the sequence ends: the block is now an unreferenced
    # GPU-only candidate.
    swapper.set_running(1, True)
    assert swapper.allocate(1, [3, 4])
    block = next(iter(swapper.store.blocks.values()))
    assert block.copies[Tier.CPU].stale
    swapper.finish(1)
    # Over the watermark it is a victim; it must wait for the copy in flight, not crash.
    swapper.end_step()
    assert Tier.GPU in block.copies
    swapper.check_integrity()
    engine.finish()
    swapper.begin_step(3)
    swapper.end_step()  # the stale copy is gone: now it can leave
    swapper.check_integrity()


def test_a_lower_copy_gone_stale_is_heard_by_the_gpu_policy_at_once() -> None:
    # A user's policy that keeps the facts it hears. A resumed block's CPU copy (kept
    # when it came back) goes when the block changes: the GPU copy has no ready copy
    # below any more (`clean` False), and the policy hears it then, not at the
    # block's next change.
    engine, swapper = block_being_swapped_out(
        PolicyOptions(sink_protection=False, min_residency_steps=0,
                      gpu_eviction_policy="tests.unit.test_eviction_policies:FifoPolicy")
    )  # fmt: skip
    engine.finish()
    swapper.begin_step(1)
    swapper.set_running(1, True)
    swapper.prefetch([1])
    engine.finish()
    swapper.begin_step(2)
    heard = swapper.store.policies[Tier.GPU]
    assert isinstance(heard, FifoPolicy)
    block = next(iter(swapper.store.blocks.values()))
    assert heard.facts[block.block_id].clean  # its CPU copy is ready
    assert swapper.allocate(1, [3, 4])  # written: the copy below is out of date
    assert Tier.CPU not in block.copies
    assert not heard.facts[block.block_id].clean
    swapper.check_integrity()
