"""The blocks with a copy on the local keyed tier (the NVMe slab), by key.

The slab says which keys it evicted (`RemoteIndex.evicted_keys`); the block store
drops those copies (`BlockStore.drop_evicted`). A key may be more than one
block's (two sequences computed the same prefix at once, and the prefix index
names the first), so each key lists every block with a copy under it, and each
of them hears its eviction. Its size is the slab's occupancy as the control
plane sees it (`Swapper.occupancy`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvswap.control.blocks import Block


class LocalKeys:
    """key -> the blocks with a copy on the local keyed tier under it."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, dict[int, Block]] = {}
        self.peak_keys = 0  # the most keys listed at once

    def __len__(self) -> int:
        """Keys listed: placed on the tier, being written included; a key it evicted
        until its copies are dropped."""
        return len(self._by_key)

    def add(self, block: Block) -> None:
        """`block` (a full one) has a copy on the local tier now."""
        assert block.key is not None, "a keyed copy is a full block's"
        self._by_key.setdefault(block.key, {})[block.block_id] = block
        self.peak_keys = max(self.peak_keys, len(self._by_key))

    def remove(self, block: Block) -> None:
        """`block`'s copy on the local tier is gone."""
        assert block.key is not None, "a keyed copy is a full block's"
        holders = self._by_key[block.key]
        del holders[block.block_id]
        if not holders:
            del self._by_key[block.key]

    def blocks(self, key: bytes) -> list[Block]:
        """The blocks with a copy under `key` (none when it is not listed)."""
        holders = self._by_key.get(key)
        return [] if holders is None else list(holders.values())

    def check(self, blocks: Iterable[Block]) -> None:
        """Raise AssertionError unless the blocks listed are exactly those of `blocks`
        with a copy on a local keyed tier, each under its key."""
        listed = {(key, block_id) for key, holders in self._by_key.items() for block_id in holders}
        for block in blocks:
            for tier in block.copies:
                if tier.keyed and tier.local:
                    assert (block.key, block.block_id) in listed, (
                        f"block {block.block_id}: a {tier.value} copy not listed by its key"
                    )
                    listed.discard((block.key, block.block_id))
        assert not listed, f"listed by key without a copy on the local tier: {sorted(listed)[:3]}"
