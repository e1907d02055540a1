"""The demoter's passes: one per slot tier, each with what lies below it."""

from __future__ import annotations

import pytest

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, direction_between
from kvswap.control.demotion import tier_pairs
from kvswap.control.settings import SwapSettings


def test_the_passes_walk_the_slot_tiers_fastest_first_with_their_watermarks() -> None:
    settings = SwapSettings(
        block_bytes=1024,
        swap_out_high_watermark=0.8,
        swap_out_low_watermark=0.6,
        cpu_demote_high_watermark=0.95,
        cpu_demote_low_watermark=0.7,
    )
    num_slots = {Tier.GPU: 1000, Tier.CPU: 499}
    gpu_cpu, cpu_below = tier_pairs(settings, num_slots)

    assert (gpu_cpu.upper, gpu_cpu.lower) == (Tier.GPU, Tier.CPU)
    assert (gpu_cpu.high_watermark, gpu_cpu.low_watermark) == (0.8, 0.6)
    # The GPU must make room: an unreferenced victim with nowhere to go is discarded,
    # and a pinned pool under half the GPU tier's size keeps its cache entries.
    assert gpu_cpu.discard_when_full and not gpu_cpu.displace_cache
    (larger, _) = tier_pairs(settings, {**num_slots, Tier.CPU: 500})
    assert larger.displace_cache  # from half the GPU tier's size, the newer entry wins

    # Below the pinned pool every tier is keyed: its victims are written to them (no
    # slot tier below), and it keeps a victim with nowhere to go.
    assert (cpu_below.upper, cpu_below.lower) == (Tier.CPU, None)
    assert (cpu_below.high_watermark, cpu_below.low_watermark) == (0.95, 0.7)
    assert not cpu_below.discard_when_full


def test_a_direction_joins_adjacent_tiers_only() -> None:
    assert direction_between(Tier.NVME, Tier.CPU) is Direction.NVME_TO_CPU
    assert direction_between(Tier.CPU, Tier.REMOTE) is Direction.CPU_TO_REMOTE
    with pytest.raises(ValueError, match="no direction from gpu to nvme"):
        direction_between(Tier.GPU, Tier.NVME)
