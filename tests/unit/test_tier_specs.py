"""The tiers described once: each `Tier` carries its facts, and the directions follow."""

from __future__ import annotations

import pytest

from kvswap.base.tier import (
    BUILT_IN_TIERS,
    SLOT_TIERS,
    Addressing,
    Tier,
    keyed_tier,
    keyed_tier_list,
    reported_tiers,
)
from kvswap.base.transfer import BUILT_IN_DIRECTIONS, Direction, direction_between
from kvswap.control.blocks import Block, Copy
from kvswap.control.store_policies import tier_facts


def test_every_direction_is_a_tier_and_the_one_it_moves_through() -> None:
    for direction in BUILT_IN_DIRECTIONS:
        src, dst = direction.src_tier, direction.dst_tier
        assert src.above is dst or dst.above is src
        # Upward: towards the GPU, what a step waits for (swap-in chunks on HIGH).
        assert direction.upward == (src.above is dst)
    # A pair of tiers names one direction.
    pairs = [(d.src_tier, d.dst_tier) for d in BUILT_IN_DIRECTIONS]
    assert len(set(pairs)) == len(pairs)
    assert {d for d in BUILT_IN_DIRECTIONS if d.upward} == {
        Direction.CPU_TO_GPU, Direction.NVME_TO_CPU, Direction.REMOTE_TO_CPU
    }  # fmt: skip


def test_addressing_decides_slots_and_keyed_chunks() -> None:
    assert SLOT_TIERS == (Tier.GPU, Tier.CPU)
    # The NVMe slab is addressed by key too, and this process's own.
    assert [t for t in BUILT_IN_TIERS if t.local] == [*SLOT_TIERS, Tier.NVME]
    assert Tier.NVME.addressing is Tier.REMOTE.addressing is Addressing.KEYS
    assert [d for d in BUILT_IN_DIRECTIONS if d.keyed] == [
        Direction.CPU_TO_NVME,
        Direction.NVME_TO_CPU,
        Direction.CPU_TO_REMOTE,
        Direction.REMOTE_TO_CPU,
    ]
    # Reads checked on the slab (CRC) and the store (value check), not in memory.
    assert [t for t in BUILT_IN_TIERS if t.checked_reads] == [Tier.NVME, Tier.REMOTE]


def test_the_built_in_tiers_are_ranked_fastest_first_and_compare_by_identity() -> None:
    assert [t.rank for t in BUILT_IN_TIERS] == [0, 1, 2, 3]
    assert [t.value for t in BUILT_IN_TIERS] == ["gpu", "cpu", "nvme", "remote"]
    twin = Tier("gpu", 0, Addressing.SLOTS, checked_reads=False, local=True, above=None)
    assert twin != Tier.GPU and len({Tier.GPU, twin}) == 2  # a tier is itself, not its facts


def test_a_direction_is_one_object_per_pair_of_adjacent_tiers() -> None:
    assert direction_between(Tier.CPU, Tier.NVME) is Direction.CPU_TO_NVME
    assert Direction.CPU_TO_NVME.value == "cpu_to_nvme" and not Direction.CPU_TO_NVME.upward
    shelf = Tier("shelf", 4, Addressing.KEYS, checked_reads=True, local=False, above=Tier.CPU)
    down, up = direction_between(Tier.CPU, shelf), direction_between(shelf, Tier.CPU)
    assert down is direction_between(Tier.CPU, shelf) and down.value == "cpu_to_shelf"
    assert down.keyed and up.keyed and up.upward and not down.upward
    with pytest.raises(ValueError, match="no direction from gpu to shelf: tiers not adjacent"):
        direction_between(Tier.GPU, shelf)


def test_a_copy_below_is_one_on_a_slower_tier_and_local_ones_are_this_process() -> None:
    block = Block(block_id=1, parent_key=b"root")
    block.copies[Tier.GPU] = Copy(slot=0)
    block.copies[Tier.REMOTE] = Copy(slot=None)
    assert block.has_ready_copy_below(Tier.GPU) and block.has_ready_copy_below(Tier.NVME)
    assert not block.has_ready_copy_below(Tier.GPU, local=True)
    assert not block.has_ready_copy_below(Tier.REMOTE)
    block.copies[Tier.NVME] = Copy(slot=None, ready=False)  # being written: not yet a copy
    assert not block.has_ready_copy_below(Tier.CPU, local=True)
    block.copies[Tier.NVME].ready = True
    assert block.has_ready_copy_below(Tier.CPU, local=True)
    del block.copies[Tier.GPU], block.copies[Tier.NVME]
    assert not block.has_local_copy()


def test_a_hit_is_served_from_the_fastest_ready_copy_else_the_one_on_its_way() -> None:
    block = Block(block_id=1, parent_key=b"root")
    block.copies[Tier.REMOTE] = Copy(slot=None)
    block.copies[Tier.CPU] = Copy(slot=3, ready=False)  # a fetch landing in the CPU
    assert block.fastest_copy_tier() is Tier.REMOTE  # ready beats faster-but-coming
    block.copies[Tier.REMOTE].stale = True
    assert block.fastest_copy_tier() is Tier.CPU  # not the GPU: it has no copy there
    block.copies[Tier.CPU].stale = True
    assert block.fastest_copy_tier() is None


def test_a_list_of_keyed_tiers_names_a_local_one_nvme_and_the_rest_by_position() -> None:
    """The NVMe slab by key (this process's own) is `Tier.NVME`, ranked below the pinned
    pool and above the shared ones; the others are `keyed_tier(i)` in order."""
    assert keyed_tier_list([True, False, False]) == (Tier.NVME, Tier.REMOTE, keyed_tier(1))
    assert keyed_tier_list([False, False]) == (Tier.REMOTE, keyed_tier(1))
    nvme = Tier.NVME
    assert (nvme.value, nvme.rank, nvme.keyed, nvme.local) == ("nvme", 2, True, True)
    assert reported_tiers((nvme, Tier.REMOTE)) == (Tier.GPU, Tier.CPU, nvme, Tier.REMOTE)
    assert reported_tiers((Tier.REMOTE, keyed_tier(1))) == (*BUILT_IN_TIERS, keyed_tier(1))
    assert reported_tiers(()) == BUILT_IN_TIERS
    for wrong in ([False, True], [True, True]):
        with pytest.raises(ValueError, match="allowed: at most one, first in the list"):
            keyed_tier_list(wrong)


def test_a_copy_on_the_nvme_slab_by_key_is_a_clean_copy_below_the_pools() -> None:
    """The policies of the pools rank a copy the slab by key holds as clean (it goes
    without a transfer), as they do one the store holds; a copy being written is not."""
    block = Block(block_id=1, parent_key=b"root", key=b"k" * 32)
    block.copies[Tier.GPU] = Copy(slot=0)
    block.copies[Tier.CPU] = Copy(slot=1)
    block.copies[Tier.NVME] = Copy(slot=None, ready=False)
    gpu, cpu = tier_facts(block)
    assert gpu is not None and cpu is not None and gpu.clean and not cpu.clean
    block.copies[Tier.NVME].ready = True
    _, cpu = tier_facts(block)
    assert cpu is not None and cpu.clean and cpu.ready_above
