"""The tiers described once: what the control plane derives from `TIER_SPECS`."""

from __future__ import annotations

from kvswap.base.transfer import (
    LOCAL_TIERS,
    REMOTE_DIRECTIONS,
    SLOT_TIERS,
    TIER_SPECS,
    TIERS_BELOW,
    Addressing,
    Direction,
    Tier,
)
from kvswap.control.blocks import Block, Copy


def test_every_direction_is_a_tier_and_the_one_it_moves_through() -> None:
    for direction in Direction:
        src, dst = direction.src_tier, direction.dst_tier
        assert src.spec.above is dst or dst.spec.above is src
        # Upward: towards the GPU, what a step waits for (swap-in chunks on HIGH).
        assert direction.upward == (src.spec.above is dst)
    # A pair of tiers names one direction.
    pairs = [(d.src_tier, d.dst_tier) for d in Direction]
    assert len(set(pairs)) == len(pairs)
    assert {d for d in Direction if d.upward} == {
        Direction.CPU_TO_GPU, Direction.NVME_TO_CPU, Direction.REMOTE_TO_CPU
    }  # fmt: skip


def test_addressing_decides_slots_and_keyed_chunks() -> None:
    assert SLOT_TIERS == (Tier.GPU, Tier.CPU, Tier.NVME)
    assert LOCAL_TIERS == SLOT_TIERS
    assert Tier.REMOTE.spec.addressing is Addressing.KEYS
    assert {Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU} == REMOTE_DIRECTIONS
    # Reads checked on the slab (CRC) and the store (value check), not in memory.
    assert [t for t, spec in TIER_SPECS.items() if spec.checked_reads] == [Tier.NVME, Tier.REMOTE]


def test_slower_tiers_follow_the_order_of_the_specs() -> None:
    assert TIERS_BELOW[Tier.GPU] == (Tier.CPU, Tier.NVME, Tier.REMOTE)
    assert TIERS_BELOW[Tier.NVME] == (Tier.REMOTE,)
    assert TIERS_BELOW[Tier.REMOTE] == ()


def test_a_hit_is_served_from_the_fastest_ready_copy_else_the_one_on_its_way() -> None:
    block = Block(block_id=1, parent_key=b"root")
    block.copies[Tier.REMOTE] = Copy(slot=None)
    block.copies[Tier.CPU] = Copy(slot=3, ready=False)  # a fetch landing in the CPU
    assert block.fastest_copy_tier() is Tier.REMOTE  # ready beats faster-but-coming
    block.copies[Tier.REMOTE].stale = True
    assert block.fastest_copy_tier() is Tier.CPU  # not the GPU: it has no copy there
    block.copies[Tier.CPU].stale = True
    assert block.fastest_copy_tier() is None
