"""vLLM's device block pool with prefix caching, as its scheduler sees it: ids, counts, hashes.

The part of vLLM 0.32's `BlockPool` (v1/core/block_pool.py) and `KVCacheManager`
that decides which device blocks a prefix hit finds, for one full-attention
group, with no tensors:

    free queue   head (reused first) ....................... tail (reused last)
                 blocks freed without a hash | blocks freed with one, oldest first

- A block is held by the requests that use it (`ref_cnt`); one held by none is on
  the free queue. vLLM's null block (its block 0) is not counted: `num_blocks` is
  the pool a request can have.
- A full block gets its hash when the scheduler commits it (`cache`), and can be
  found by that hash while it is held or free. It leaves the cache only when the
  free queue hands it out again (`allocate`): an LRU eviction.
- A prefix hit takes cached blocks (`touch`): off the free queue, one more holder.
- A request frees its blocks tail first (`free`), so its tail is evicted before its
  head: what stays cached is still a prefix.
- Two blocks may hold the same hash (two requests computed it); a hit takes the
  first one cached, as vLLM's `get_one_block` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class DevicePool:
    """`num_blocks` device blocks, ids 0..num_blocks-1 (module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # The free queue: insertion order is reuse order (vLLM's initial queue is by id).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, dict[int, None]] = {}  # hash -> blocks holding it
        self.num_evicted_blocks = 0  # cached blocks handed out again

    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        """Held by no request (an eviction candidate if it has a hash)."""
        return self._ref_cnt[block_id] == 0

    def longest_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `block_hashes[:max_blocks]`."""
        hit: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            holders = self._cached.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def touch(self, block_ids: Iterable[int]) -> None:
        """A prefix hit: each block gets one more holder (off the free queue if it had none)."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks from the head of the free queue, each evicted from the cache
        if it was cached; the caller checked `num_free_blocks`."""
        assert num_blocks <= len(self._free), "allocate past the free blocks"
        taken = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            old_hash = self._hash[block_id]
            if old_hash is not None:
                holders = self._cached[old_hash]
                del holders[block_id]
                if not holders:
                    del self._cached[old_hash]
                self._hash[block_id] = None
                self.num_evicted_blocks += 1
            self._ref_cnt[block_id] = 1
            taken.append(block_id)
        return taken

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """A full block is committed: findable by `block_hash` from now on."""
        if self._hash[block_id] is not None:
            return
        self._hash[block_id] = block_hash
        self._cached.setdefault(block_hash, {})[block_id] = None

    def free(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks (in its order; they are freed tail first)."""
        first: list[int] = []  # no hash: reused first (vLLM's LIFO for uncached blocks)
        last: list[int] = []  # cached: reused last, the tail's blocks before the head's
        for block_id in reversed(block_ids):
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                (last if self._hash[block_id] is not None else first).append(block_id)
        for block_id in reversed(first):  # prepended in order: first[0] at the head
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        for block_id in last:
            self._free[block_id] = None

    def check_integrity(self) -> None:
        """The free queue is exactly the blocks nobody holds; the cache names each
        hashed block once."""
        assert set(self._free) == {b for b in range(self.num_blocks) if self._ref_cnt[b] == 0}
        assert all(count >= 0 for count in self._ref_cnt)
        named = {b for holders in self._cached.values() for b in holders}
        assert named == {b for b in range(self.num_blocks) if self._hash[b] is not None}
