"""The demoter's pairs: derived from the tier table, one per pair of adjacent slot tiers."""

from __future__ import annotations

import pytest

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, direction_between
from kvswap.control.demotion import tier_pairs
from kvswap.control.settings import SwapSettings


def test_pairs_walk_adjacent_slot_tiers_fastest_first_with_their_watermarks() -> None:
    settings = SwapSettings(
        block_bytes=1024,
        swap_out_high_watermark=0.8,
        swap_out_low_watermark=0.6,
        cpu_demote_high_watermark=0.95,
        cpu_demote_low_watermark=0.7,
    )
    num_slots = {Tier.GPU: 1000, Tier.CPU: 499, Tier.NVME: 64}
    gpu_cpu, cpu_nvme = tier_pairs(settings, num_slots)  # the store takes no slot: no pair

    assert (gpu_cpu.upper, gpu_cpu.lower, gpu_cpu.direction) == (
        Tier.GPU, Tier.CPU, Direction.GPU_TO_CPU,
    )  # fmt: skip
    assert (gpu_cpu.high_watermark, gpu_cpu.low_watermark) == (0.8, 0.6)
    # The GPU must make room: an unreferenced victim with nowhere to go is discarded,
    # and a pinned pool under half the GPU tier's size keeps its cache entries.
    assert gpu_cpu.discard_when_full and not gpu_cpu.displace_cache
    (larger, _) = tier_pairs(settings, {**num_slots, Tier.CPU: 500})
    assert larger.displace_cache  # from half the GPU tier's size, the newer entry wins

    assert (cpu_nvme.upper, cpu_nvme.lower, cpu_nvme.direction) == (
        Tier.CPU, Tier.NVME, Direction.CPU_TO_NVME,
    )  # fmt: skip
    assert (cpu_nvme.high_watermark, cpu_nvme.low_watermark) == (0.95, 0.7)
    # NVMe takes newer blocks in place of older ones; the pinned pool keeps a victim
    # with nowhere to go.
    assert cpu_nvme.displace_cache and not cpu_nvme.discard_when_full


def test_a_direction_joins_adjacent_tiers_only() -> None:
    assert direction_between(Tier.NVME, Tier.CPU) is Direction.NVME_TO_CPU
    assert direction_between(Tier.CPU, Tier.REMOTE) is Direction.CPU_TO_REMOTE
    with pytest.raises(ValueError, match="no direction from gpu to nvme"):
        direction_between(Tier.GPU, Tier.NVME)
