"""Which keys the keyed store holds for this process: a paused sequence's only copies.

A keyed store that can hold keys (`RemoteIndex.holds_keys`: a tier evicting by
its own policy in this process's keeping, not a store shared with others) is
asked to hold the key of every block of a paused or waiting sequence, from the
moment its write is planned:

    held  <=>  a sequence references the block, the store has (or is being
               written) a copy of it, and it has no ready GPU copy

The hold is released once the block is on the GPU again or nobody references
it. `BlockStore` calls `sync(block)` after every change that can alter one of
these. Held from the write on, not from the moment the store's copy becomes the
only one: the tier may evict a key between its write landing and this process
hearing of it. A store that cannot hold gets `NO_HOLDS`, and may evict such a
key: the fetch then fails and the block is recomputed, never read wrong.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.transfer import GPU_TIER, REMOTE_TIER
from kvswap.control.blocks import Block


class KeyHolds:
    """The holds this process keeps in `index` (module docstring)."""

    def __init__(self, index: RemoteIndex) -> None:
        self.index = index
        self._held: set[int] = set()  # ids of the blocks whose key is held

    def sync(self, block: Block) -> None:
        """Hold or release `block`'s key so that it is held exactly when the rule says."""
        remote = block.copies.get(REMOTE_TIER)
        wanted = (
            block.ref_count > 0
            and not block.lost
            and remote is not None
            and not remote.stale
            and block.ready_copy(GPU_TIER) is None
        )
        held = block.block_id in self._held
        if wanted is held:
            return
        assert block.key is not None, "only full (keyed) blocks have a remote copy"
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
                f"block {block.block_id}: hold out of step"
            )


class _NoHolds(KeyHolds):
    """A store that cannot hold: nothing to keep in step."""

    def __init__(self) -> None:
        pass

    def sync(self, block: Block) -> None:
        return None

    def check(self, blocks: Iterable[Block]) -> None:
        return None


NO_HOLDS: KeyHolds = _NoHolds()


def key_holds(index: RemoteIndex | None) -> KeyHolds:
    """The holds to keep in `index`: `NO_HOLDS` without a store, or one that cannot hold."""
    return KeyHolds(index) if index is not None and index.holds_keys else NO_HOLDS
