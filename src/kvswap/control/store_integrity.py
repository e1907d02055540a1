"""The block store's invariants, checked (tests and the state machine call it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvswap.control.store import BlockStore


def check_store_integrity(store: BlockStore) -> None:
    """Every slot has one owner, each tier's occupancy equals the copies on it,
    references equal the tables that hold each block."""
    for tier_slots in store.tiers.values():
        tier_slots.check_integrity()
    counted = {tier: 0 for tier in store.tiers}
    num_remote = 0
    for block in store.blocks.values():
        assert block.ref_count > 0 or block.has_local_copy() or block.lost, (
            f"block {block.block_id}: unreferenced and only in the remote store"
        )
        for tier, copy in block.copies.items():
            if copy.slot is None:
                num_remote += 1
                continue
            owner = store.tiers[tier].owner(copy.slot)
            assert owner == block.block_id, (
                f"{tier.value} slot {copy.slot}: owner {owner}, copy of {block.block_id}"
            )
            counted[tier] += 1
    assert num_remote == store.num_remote_copies, (
        f"remote: {num_remote} copies but {store.num_remote_copies} counted"
    )
    for tier, tier_slots in store.tiers.items():
        assert counted[tier] == tier_slots.num_used_slots, (
            f"{tier.value}: {counted[tier]} copies but {tier_slots.num_used_slots} used slots"
        )
    refs: dict[int, int] = {}
    for state in store.sequences.values():
        for block_id in state.block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for block in store.blocks.values():
        assert block.ref_count == refs.get(block.block_id, 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"tables {refs.get(block.block_id, 0)}"
        )
