"""TierSlots: slot order, ownership checks, and memory only for the slots in use."""

from __future__ import annotations

import pytest

from kvswap.base.tier import Tier
from kvswap.control.tiers import TierSlots


def test_slots_go_lowest_first_and_the_last_released_comes_back_first() -> None:
    slots = TierSlots(Tier.CPU, 4)
    assert [slots.allocate(block_id) for block_id in (10, 11, 12)] == [0, 1, 2]
    slots.release(1, 11)
    slots.release(0, 10)
    assert slots.num_used_slots == 1 and slots.num_free_slots == 3
    # Released slots first (the last released first), then the never-used one.
    assert [slots.allocate(block_id) for block_id in (20, 21, 22)] == [0, 1, 3]
    assert slots.allocate(23) is None  # full
    assert slots.owner(3) == 22 and slots.owner(2) == 12
    assert slots.peak_used_slots == 4
    slots.check_integrity()


def test_a_slot_released_by_another_block_is_a_bug() -> None:
    slots = TierSlots(Tier.GPU, 2)
    slot = slots.allocate(7)
    assert slot is not None
    with pytest.raises(AssertionError, match="released by block 8 but owned by 7"):
        slots.release(slot, 8)
    with pytest.raises(AssertionError, match="owned by None"):
        slots.release(1, 7)  # never handed out


def test_a_huge_tier_costs_only_the_slots_in_use() -> None:
    """A tier sized from a large card for a tiny model (tens of millions of 1-token
    blocks) used to build two lists of that length before the first step."""
    slots = TierSlots(Tier.GPU, 10**15)
    assert slots.allocate(1) == 0 and slots.allocate(2) == 1
    assert slots.num_free_slots == 10**15 - 2
    slots.release(0, 1)
    slots.check_integrity()


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="num_slots must be >= 0"):
        TierSlots(Tier.NVME, -1)
