"""kvswap's policy: LRU, plus sink protection, minimum residency and cost ranks.

Every call is O(1) (amortised): candidates live in a few LRU-ordered dicts,
one per cost rank (`RankedLru`), and GPU copies inside their minimum
residency window wait in a FIFO that `advance` drains. No call scans all
blocks, so 100k blocks cost the same per decision as 10. One class per rank
table, sharing `RankedLruPolicy`:

GPU copies (`KvSwapGpuPolicy`), cheapest victim first when cost-aware:

    0  unreferenced, a ready copy below  -> dropped, no transfer
    1  unreferenced, GPU copy only       -> copied out, then freed
    2  paused sequence, a copy below     -> dropped; swapped in again on resume
    3  paused sequence, GPU copy only    -> copied out; swapped in again on resume
    -  running, protected, busy, young   -> not a candidate

Unreferenced blocks (finished requests, prefix cache) go first because nobody
is known to need them; paused sequences will need theirs back on resume, and
swap-in is the expensive direction. "Young": brought back from a slower tier
less than `min_residency_steps` steps ago, and referenced (the window protects
blocks someone brought back to use). The policy keeps these windows itself.

CPU and NVMe copies (`KvSwapLowerTierPolicy`, one rank table for a tier below the
GPU making room): the pinned pool, to take GPU victims and to demote; the NVMe
slab, to take demotions (CPU -> NVMe) of newer blocks:

    0  a ready copy on a slower tier       -> drop this copy (NVMe: a remote copy)
    1  unreferenced, this is the only copy -> demote, or discard the cache entry
    2  a ready copy on a faster tier       -> drop (the copy above becomes dirty)
    3  referenced, this is the only copy   -> demote only; never discarded (on NVMe,
                                              the last local tier: never a victim
                                              of `evict(droppable_only=True)`)
    -  busy                                -> not a candidate

"Slower" and "faster" come with the facts (`clean`, `ready_above`), which the
store computes for the tier the copy is on; the table itself is the same.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from typing import ClassVar

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier


class RankedLru:
    """Keys in a few LRU-ordered lists, one per cost rank; every call O(1)."""

    def __init__(self, num_ranks: int):
        self.lists: list[OrderedDict[BlockKey, None]] = [OrderedDict() for _ in range(num_ranks)]
        self.rank_of: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self.rank_of)

    def place(self, key: BlockKey, rank: int | None, *, refresh: bool) -> None:
        """Put `key` at `rank` (None: not a candidate). An unchanged rank keeps its
        LRU position unless `refresh`, which makes it the most recently used."""
        rank_of, lists = self.rank_of, self.lists  # locals: called for every re-rank
        old = rank_of.get(key)
        if old == rank:
            if refresh and rank is not None:
                lists[rank].move_to_end(key)
            return
        if old is not None:
            del lists[old][key]
        if rank is None:
            del rank_of[key]
        else:
            lists[rank][key] = None
            rank_of[key] = rank

    def remove(self, key: BlockKey) -> None:
        old = self.rank_of.pop(key, None)
        if old is not None:
            del self.lists[old][key]

    def move_to_end(self, key: BlockKey) -> None:
        rank = self.rank_of.get(key)
        if rank is not None:
            self.lists[rank].move_to_end(key)

    def check_integrity(self) -> None:
        assert sum(map(len, self.lists)) == len(self.rank_of), "rank index out of step"
        for rank, ranked in enumerate(self.lists):
            for key in ranked:
                assert self.rank_of[key] == rank


class RankedLruPolicy(EvictionPolicy):
    """A `RankedLru` of candidates ranked by `rank(key, facts)`, plus the last facts
    of every key held. `evict` takes the least recently used key of the cheapest
    non-empty rank, n times."""

    num_ranks: ClassVar[int] = 4
    #: Whether every `update` makes the key the most recently used of its rank.
    refresh_on_update: ClassVar[bool] = False

    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._lru = RankedLru(self.num_ranks)
        self._facts: dict[BlockKey, BlockFacts] = {}

    @abstractmethod
    def rank(self, key: BlockKey, facts: BlockFacts) -> int | None:
        """The cost rank of a copy (0 cheapest); None: not a candidate now."""

    def max_droppable_rank(self) -> int:
        """Ranks above this one hold no `droppable` copy (an `evict` bound only)."""
        return self.num_ranks - 1

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        self._facts[key] = facts
        self._lru.place(key, self.rank(key, facts), refresh=self.refresh_on_update)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        held = self._facts
        if held.get(key) == facts:  # the rank holds: only the recency may change
            if self.refresh_on_update:
                self._lru.move_to_end(key)
            return
        held[key] = facts
        self._lru.place(key, self.rank(key, facts), refresh=self.refresh_on_update)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._lru.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._facts.pop(key, None)
        lru = self._lru  # `RankedLru.remove` written out: called for every copy dropped
        old = lru.rank_of.pop(key, None)
        if old is not None:
            del lru.lists[old][key]

    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        if n == 1 and not protected:  # the store's every call (`pop_victim`)
            lists = self._lru.lists
            if droppable_only:
                lists = lists[: self.max_droppable_rank() + 1]
            for ranked in lists:
                for key in ranked:  # the least recently used first; returns on a pick
                    if droppable_only and not self._facts[key].droppable:
                        continue
                    del ranked[key], self._lru.rank_of[key], self._facts[key]
                    return [key]
            return None
        max_rank = self.max_droppable_rank() if droppable_only else self.num_ranks - 1
        picked: list[BlockKey] = []
        for ranked in self._lru.lists[: max_rank + 1]:
            if len(picked) == n:
                break
            for key in ranked:
                if key in protected or (droppable_only and not self._facts[key].droppable):
                    continue
                picked.append(key)
                if len(picked) == n:
                    break
        if len(picked) < n:
            return None
        for key in picked:
            self._lru.remove(key)
            del self._facts[key]
        return picked

    def num_candidates(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._lru = RankedLru(self.num_ranks)
        self._facts.clear()

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:
        self._lru.check_integrity()
        for key in self._lru.rank_of:
            assert key in self._facts, f"candidate {key} has no facts"
        for key in self._facts:
            assert key in keys_with_copy, f"{self.tier.value}: key {key} held without a copy"


class KvSwapGpuPolicy(RankedLruPolicy):
    """Ranked LRU over GPU copies, with sink protection and minimum residency windows."""

    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._step = 0
        self._until: dict[BlockKey, int] = {}  # key -> end of its residency window (step)
        # (until, key): FIFO in expiry order, since every window has the same length
        # and keys enter in step order. An entry whose window was restarted since is
        # skipped. A window outlives `remove` (a victim that stays is still young)
        # and ends only here, so `_until` holds at most a window's arrivals.
        self._young: deque[tuple[int, BlockKey]] = deque()

    def advance(self, step: int) -> None:
        """Move to decode step `step`; copies whose residency window ended are re-ranked."""
        self._step = step
        young, until = self._young, self._until
        while young and young[0][0] <= step:
            end, key = young.popleft()
            if until.get(key) != end:
                continue
            del until[key]
            facts = self._facts.get(key)
            if facts is not None:
                self._lru.place(key, self.rank(key, facts), refresh=False)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        if facts.brought_back and self.options.min_residency_steps > 0:
            end = self._step + self.options.min_residency_steps
            self._until[key] = end
            self._young.append((end, key))
        elif self._facts.get(key) == facts:
            return  # same facts, same window: same rank (an update is not a use here)
        self._facts[key] = facts
        self._lru.place(key, self.rank(key, facts), refresh=False)

    def rank(self, key: BlockKey, facts: BlockFacts) -> int | None:
        if facts.busy or facts.lost or facts.running:
            return None
        if facts.sink and self.options.sink_protection:
            return None
        if facts.referenced and self._until.get(key, 0) > self._step:
            return None  # the window protects blocks someone brought back to use
        if not self.options.cost_aware:
            return 0
        if not facts.referenced:
            return 0 if facts.clean else 1
        return 2 if facts.clean else 3

    def max_droppable_rank(self) -> int:
        # Rank 3 (referenced, GPU copy only) is never droppable; without cost ranks
        # everything is rank 0 and `evict` checks each key.
        return 2 if self.options.cost_aware else 0

    def clear(self) -> None:
        super().clear()
        self._until.clear()
        self._young.clear()


class KvSwapLowerTierPolicy(RankedLruPolicy):
    """Ranked LRU over the copies of a tier below the GPU (CPU, NVMe). Its recency is
    the last change of the block (a copy made or dropped, a transfer started or ended,
    a reference taken): every `update` refreshes, and a read on the GPU (`touch`) does
    not reorder the copies below."""

    refresh_on_update = True

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        # `RankedLruPolicy.update` with its calls written out: this runs for every
        # change of every CPU and NVMe copy (same facts: only the recency changes).
        held, lru = self._facts, self._lru
        if held.get(key) == facts:
            rank = lru.rank_of.get(key)
            if rank is not None:
                lru.lists[rank].move_to_end(key)
            return
        held[key] = facts
        lru.place(key, self.rank(key, facts), refresh=True)

    def rank(self, key: BlockKey, facts: BlockFacts) -> int | None:
        if facts.busy or facts.lost:
            return None
        if facts.clean:
            return 0
        if not facts.referenced:
            return 1
        if facts.ready_above:
            return 2
        return 3

    def max_droppable_rank(self) -> int:
        return 2  # rank 3: referenced, and this is its only ready copy

    def touch(self, keys: Iterable[BlockKey]) -> None:
        pass
