"""Which keys the keyed tiers hold for this process: a paused sequence's only copies.

A keyed tier that can hold keys (`RemoteIndex.holds_keys`: a tier evicting by
its own policy in this process's keeping, not a store shared with others) is
asked to hold the key of every block of a paused or waiting sequence, from the
moment its write is planned:

    held  <=>  a sequence references the block, the store has (or is being
               written) a copy of it, and it has no ready GPU copy

The hold is released once the block is on the GPU again or nobody references
it. `BlockStore` calls `sync(block)` after every change that can alter one of
these. Held from the write on, not from the moment the store's copy becomes the
only one: the tier may evict a key between its write landing and this process
hearing of it. Each keyed tier that can hold has its `KeyHolds` (`key_holds`
makes one object of them for the store); a store that cannot hold may evict such
a key: the fetch then fails and the block is recomputed, never read wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.tier import GPU_TIER, Tier
from kvswap.control.blocks import Block


class KeyHolds:
    """The holds this process keeps in one keyed tier, `index` (module docstring)."""

    def __init__(self, index: RemoteIndex, tier: Tier) -> None:
        self.index = index
        self.tier = tier
        self._held: set[int] = set()  # ids of the blocks whose key is held

    def sync(self, block: Block) -> None:
        """Hold or release `block`'s key so that it is held exactly when the rule says."""
        copy = block.copies.get(self.tier)
        wanted = (
            block.ref_count > 0
            and not block.lost
            and copy is not None
            and not copy.stale
            and block.ready_copy(GPU_TIER) is None
        )
        held = block.block_id in self._held
        if wanted is held:
            return
        assert block.key is not None, "only full (keyed) blocks have a keyed copy"
        if wanted:
            self._held.add(block.block_id)
            self.index.hold((block.key,))
        else:
            self._held.discard(block.block_id)
            self.index.release((block.key,))

    def check(self, blocks: Iterable[Block]) -> None:
        """Raise AssertionError unless every block's hold follows the rule."""
        for block in blocks:
            held = block.block_id in self._held
            self.sync(block)
            assert (block.block_id in self._held) is held, (
                f"block {block.block_id}: hold out of step in {self.tier.value}"
            )


class _AllHolds(KeyHolds):
    """The holds of several keyed tiers, kept in step together."""

    def __init__(self, holds: Sequence[KeyHolds]) -> None:
        self._holds = tuple(holds)

    def sync(self, block: Block) -> None:
        for holds in self._holds:
            holds.sync(block)

    def check(self, blocks: Iterable[Block]) -> None:
        listed = list(blocks)
        for holds in self._holds:
            holds.check(listed)


#: No keyed tier that can hold keys: nothing to keep in step.
NO_HOLDS: KeyHolds = _AllHolds(())


def key_holds(indexes: Mapping[Tier, RemoteIndex]) -> KeyHolds:
    """The holds to keep in the keyed tiers `indexes` (by tier): one `KeyHolds` per
    tier that can hold keys, as one object; `NO_HOLDS` when none can."""
    holds = [KeyHolds(index, tier) for tier, index in indexes.items() if index.holds_keys]
    if not holds:
        return NO_HOLDS
    return holds[0] if len(holds) == 1 else _AllHolds(holds)
