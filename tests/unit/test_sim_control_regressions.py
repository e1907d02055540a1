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


def resumed_block_being_demoted(options: PolicyOptions) -> tuple[ManualCopyEngine, Swapper]:
    """2 GPU slots (swap out from 1 used), 1 CPU slot (demote when full), 4 tokens per
    block. A sequence with one partial block is preempted (block -> CPU), then
    resumes (block -> GPU again; its CPU copy stays); the CPU tier is full, so that
    copy starts moving to NVMe, and the chunk stays in flight."""
    engine = ManualCopyEngine()
    swapper = Swapper(
        StoreLayout(4, 2, 1, 2, 0),
        options,
        SwapSettings(block_bytes=100, swap_out_high_watermark=0.5, swap_out_low_watermark=0.0,
                     swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
                     cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5),
        engine,
        clock_s=lambda: 0.0,
    )  # fmt: skip
    swapper.open_sequence(1, [1, 2])
    assert swapper.allocate(1, [1, 2])
    swapper.swap_out_sequence(1)
    engine.finish()
    swapper.begin_step(1)
    swapper.set_running(1, True)
    swapper.prefetch([1])
    engine.finish()
    swapper.begin_step(2)
    swapper.end_step()
    assert [c.direction for c in engine.pending.values()] == [Direction.CPU_TO_NVME]
    return engine, swapper


def test_a_victim_whose_stale_cpu_copy_is_still_being_demoted_stays_on_the_gpu() -> None:
    # Found on a 12k-request trace: AssertionError "block ... already has a cpu copy".
    engine, swapper = resumed_block_being_demoted(
        PolicyOptions(sink_protection=False, min_residency_steps=0)
    )
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


def test_a_lower_copy_gone_stale_in_flight_is_heard_by_the_gpu_policy_at_once() -> None:
    # The scenario above, with a user's policy that keeps the facts it hears. Its
    # block's CPU and NVMe copies go stale while a demotion still reads the CPU
    # one: the GPU copy has no ready copy below any more (`clean` False), and the
    # policy hears it then, not at the block's next change.
    _engine, swapper = resumed_block_being_demoted(
        PolicyOptions(sink_protection=False, min_residency_steps=0,
                      gpu_eviction_policy="tests.unit.test_eviction_policies:FifoPolicy")
    )  # fmt: skip
    heard = swapper.store.policies[Tier.GPU]
    assert isinstance(heard, FifoPolicy)
    block = next(iter(swapper.store.blocks.values()))
    assert heard.facts[block.block_id].clean  # its CPU copy is ready
    assert swapper.allocate(1, [3, 4])  # written: the copies below go stale, one in flight
    assert block.copies[Tier.CPU].stale
    assert not heard.facts[block.block_id].clean
    swapper.check_integrity()
