"""Block key -> block, so identical prefixes share blocks across sequences and turns.

Only full blocks are indexed. A lookup walks a token list block by block,
chaining keys from the sequence's root key, and stops at the first miss. A key
found is only a candidate: the hit is confirmed by its tokens and by its
parent (the previous hit, or a block holding the same prefix; the root for
the first block), so even a forced key collision costs a miss, never wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.base import identity
from kvswap.control.blocks import Block, same_prefix


class PrefixIndex:
    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._by_key: dict[bytes, Block] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def insert(self, block: Block) -> None:
        """Index a full block (first writer wins; an equal block already indexed stays)."""
        assert block.key is not None, "only full blocks are indexed"
        self._by_key.setdefault(block.key, block)

    def remove(self, block: Block) -> None:
        if block.key is not None and self._by_key.get(block.key) is block:
            del self._by_key[block.key]

    def match(
        self, parent_key: bytes, token_ids: Sequence[int], previous: Block | None = None
    ) -> list[Block]:
        """The longest run of indexed full blocks that prefixes `token_ids` after
        `previous`, the block keyed `parent_key` (None: `parent_key` is a root key)."""
        hits: list[Block] = []
        size = self.block_tokens
        for start in range(0, len(token_ids) - size + 1, size):
            chunk = list(token_ids[start : start + size])
            # Looked up through the module so that tests can force collisions.
            key = identity.chain_key(parent_key, chunk)
            block = self._by_key.get(key)
            if block is None or block.lost or block.token_ids != chunk:
                break
            if not self._follows(block, parent_key, hits[-1] if hits else previous):
                break
            hits.append(block)
            parent_key = key
        return hits

    @staticmethod
    def _follows(block: Block, parent_key: bytes, previous: Block | None) -> bool:
        """Whether `block` was computed after the prefix confirmed so far."""
        if block.parent_key != parent_key:
            return False
        if previous is None:
            return block.parent is None
        # Usually its parent is the previous hit itself; otherwise (a duplicate chain
        # computed concurrently, or a parent forgotten and recomputed) compare prefixes.
        return block.parent is previous or (
            block.parent is not None and same_prefix(block.parent, previous)
        )
