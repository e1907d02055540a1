"""Prefix hash -> block, so identical prefixes share blocks across sequences and turns.

Only full blocks are indexed. A lookup walks a token list block by block,
chaining hashes, and stops at the first miss; each hit is confirmed against
the stored token ids, so a hash collision can cost a miss but never wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.control.blocks import ROOT_HASH, Block, chain_hash


class PrefixIndex:
    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._by_hash: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def insert(self, block: Block) -> None:
        """Index a full block (first writer wins; an equal block already indexed stays)."""
        assert block.prefix_hash is not None, "only full blocks are indexed"
        self._by_hash.setdefault(block.prefix_hash, block)

    def remove(self, block: Block) -> None:
        if block.prefix_hash is not None and self._by_hash.get(block.prefix_hash) is block:
            del self._by_hash[block.prefix_hash]

    def match(self, token_ids: Sequence[int]) -> list[Block]:
        """The longest run of indexed full blocks that prefixes `token_ids`."""
        hits: list[Block] = []
        parent = ROOT_HASH
        size = self.block_tokens
        for start in range(0, len(token_ids) - size + 1, size):
            chunk = tuple(token_ids[start : start + size])
            key = chain_hash(parent, chunk)
            block = self._by_hash.get(key)
            if block is None or block.lost or tuple(block.token_ids) != chunk:
                break
            hits.append(block)
            parent = key
        return hits
