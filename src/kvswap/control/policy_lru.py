"""Plain LRU: the least recently inserted or touched copy that may leave now.

No sink protection, no residency window, no cost ranks: the baseline kvswap's
policy is measured against (`gpu_eviction_policy = "lru"`). Only the hard rule
holds: a busy, lost or running copy is skipped, and keeps its place in the
recency order until it may leave.

A touch refreshes a sequence's blocks tail first, so the chain's head ends up
the most recently used, as vLLM's LRU refreshes a request's keys tail to head:
a chain then leaves from its end and what stays is still a usable prefix.

The recency order is a `RecencyHeap` (policy_recency.py), O(log n) per call.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.control.policy_recency import RecencyEntry, RecencyHeap


class LruPolicy(EvictionPolicy):
    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._facts: dict[BlockKey, BlockFacts] = {}
        self._recency = RecencyHeap()
        self._num_candidates = 0

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        self._set(key, facts)
        self._recency.use(key, candidate=facts.may_leave)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        if key not in self._facts:
            self.insert(key, facts)
        else:
            self._set(key, facts)
            self._recency.set_candidate(key, candidate=facts.may_leave)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in reversed(list(keys)):
            facts = self._facts.get(key)
            if facts is not None:
                self._recency.use(key, candidate=facts.may_leave)

    def remove(self, key: BlockKey) -> None:
        facts = self._facts.pop(key, None)
        if facts is not None:
            self._num_candidates -= facts.may_leave
            self._recency.discard(key)

    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        recency = self._recency
        picked: list[RecencyEntry] = []
        passed: list[RecencyEntry] = []  # candidates not wanted now: they stay
        while len(picked) < n and (entry := recency.pop_oldest()) is not None:
            key = entry[1]
            if key in protected or (droppable_only and not self._facts[key].droppable):
                passed.append(entry)
            else:
                picked.append(entry)
        for entry in passed:
            recency.push_back(entry)
        if len(picked) < n:
            for entry in picked:
                recency.push_back(entry)
            return None
        for _, key in picked:
            self.remove(key)
        return [key for _, key in picked]

    def num_candidates(self) -> int:
        return self._num_candidates

    def clear(self) -> None:
        self._facts.clear()
        self._recency.clear()
        self._num_candidates = 0

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:
        assert len(self._recency) == len(self._facts), "facts and stamps out of step"
        assert all(key in self._recency for key in self._facts), "facts and stamps out of step"
        candidates = [key for key, facts in self._facts.items() if facts.may_leave]
        assert self._num_candidates == len(candidates)
        self._recency.check_integrity(candidates)
        for key in self._facts:
            assert key in keys_with_copy, f"{self.tier.value}: key {key} held without a copy"

    # ------------------------------------------------------------------ internal

    def _set(self, key: BlockKey, facts: BlockFacts) -> None:
        old = self._facts.get(key)
        self._num_candidates += facts.may_leave - (old is not None and old.may_leave)
        self._facts[key] = facts
