"""Plain LRU: the least recently inserted or touched copy that may leave now.

No sink protection, no residency window, no cost ranks: the baseline kvswap's
policy is measured against (`gpu_eviction_policy = "lru"`). Only the hard rule
holds: a busy, lost or running copy is skipped, and keeps its place in the
recency order until it may leave.

Candidates sit in a heap by last use, O(log n) per call. An entry stands for
its key only while it carries the key's last-use stamp; entries left behind by
a touch or a removal are skipped when they surface and the heap is rebuilt
once they outnumber the keys.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable

from kvswap.control.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.control.transfer import Tier


class LruPolicy(EvictionPolicy):
    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._facts: dict[BlockKey, BlockFacts] = {}
        self._used: dict[BlockKey, int] = {}  # key -> stamp of its last insert or touch
        self._queued: dict[BlockKey, int] = {}  # key -> stamp of its heap entry, if any
        self._heap: list[tuple[int, BlockKey]] = []  # (stamp, key); unique stamps
        self._stamps = itertools.count()
        self._num_candidates = 0

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        self._used[key] = next(self._stamps)
        self._set(key, facts)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        if key not in self._facts:
            self.insert(key, facts)
        else:
            self._set(key, facts)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            facts = self._facts.get(key)
            if facts is not None:
                self._used[key] = next(self._stamps)
                self._queue(key, facts)

    def remove(self, key: BlockKey) -> None:
        facts = self._facts.pop(key, None)
        if facts is not None:
            self._num_candidates -= facts.may_leave
            del self._used[key]
            self._queued.pop(key, None)

    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        picked: list[tuple[int, BlockKey]] = []
        passed: list[tuple[int, BlockKey]] = []  # candidates not wanted now: they stay
        while self._heap and len(picked) < n:
            entry = heapq.heappop(self._heap)
            stamp, key = entry
            if self._queued.get(key) != stamp:
                continue  # left behind by a touch or a removal
            facts = self._facts[key]
            if not facts.may_leave:
                del self._queued[key]  # queued again when it may leave
            elif key in protected or (droppable_only and not facts.droppable):
                passed.append(entry)
            else:
                picked.append(entry)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        if len(picked) < n:
            for entry in picked:
                heapq.heappush(self._heap, entry)
            return None
        for _, key in picked:
            self.remove(key)
        return [key for _, key in picked]

    def num_candidates(self) -> int:
        return self._num_candidates

    def clear(self) -> None:
        self._facts.clear()
        self._used.clear()
        self._queued.clear()
        self._heap.clear()
        self._num_candidates = 0

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:
        assert self._facts.keys() == self._used.keys(), "facts and stamps out of step"
        assert self._num_candidates == sum(f.may_leave for f in self._facts.values())
        for key in self._facts:
            assert key in keys_with_copy, f"{self.tier.value}: key {key} held without a copy"
        for key, facts in self._facts.items():
            if facts.may_leave:
                assert self._queued.get(key) == self._used[key], f"candidate {key} not queued"

    # ------------------------------------------------------------------ internal

    def _set(self, key: BlockKey, facts: BlockFacts) -> None:
        old = self._facts.get(key)
        self._num_candidates += facts.may_leave - (old is not None and old.may_leave)
        self._facts[key] = facts
        self._queue(key, facts)

    def _queue(self, key: BlockKey, facts: BlockFacts) -> None:
        """Give a key that may leave a heap entry with its last-use stamp."""
        stamp = self._used[key]
        if facts.may_leave and self._queued.get(key) != stamp:
            self._queued[key] = stamp
            heapq.heappush(self._heap, (stamp, key))
            if len(self._heap) > 2 * len(self._facts) + 64:
                self._rebuild()

    def _rebuild(self) -> None:
        self._queued = {k: self._used[k] for k, f in self._facts.items() if f.may_leave}
        self._heap = [(stamp, key) for key, stamp in self._queued.items()]
        heapq.heapify(self._heap)
