"""The block store's invariants, checked (tests and the state machine call it)."""

from __future__ import annotations

from collections.abc import Mapping

from kvswap.base.tier import Tier
from kvswap.control.blocks import Block
from kvswap.control.store_records import SequenceState
from kvswap.control.tiers import TierSlots


def check_store_integrity(
    tiers: Mapping[Tier, TierSlots],
    blocks: Mapping[int, Block],
    sequences: Mapping[int, SequenceState],
    num_remote_copies: int,
) -> None:
    """Every slot has one owner, each tier's occupancy equals the copies on it, the
    shared keyed tiers' copies are counted, references equal the tables that hold each
    block (a `BlockStore`'s parts; the local keyed tier's: `LocalKeys.check`)."""
    for tier_slots in tiers.values():
        tier_slots.check_integrity()
    counted = {tier: 0 for tier in tiers}
    num_remote = 0
    for block in blocks.values():
        assert block.ref_count > 0 or block.has_local_copy() or block.lost, (
            f"block {block.block_id}: unreferenced and only in the remote store"
        )
        for tier, copy in block.copies.items():
            if copy.slot is None:
                num_remote += not tier.local
                continue
            owner = tiers[tier].owner(copy.slot)
            assert owner == block.block_id, (
                f"{tier.value} slot {copy.slot}: owner {owner}, copy of {block.block_id}"
            )
            counted[tier] += 1
    assert num_remote == num_remote_copies, (
        f"remote: {num_remote} copies but {num_remote_copies} counted"
    )
    for tier, tier_slots in tiers.items():
        assert counted[tier] == tier_slots.num_used_slots, (
            f"{tier.value}: {counted[tier]} copies but {tier_slots.num_used_slots} used slots"
        )
    refs: dict[int, int] = {}
    for state in sequences.values():
        for block_id in state.block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for block in blocks.values():
        assert block.ref_count == refs.get(block.block_id, 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"tables {refs.get(block.block_id, 0)}"
        )
