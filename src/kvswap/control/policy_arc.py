"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), as vLLM runs it.

vLLM's offloading connector lets its users pick "lru" or "arc" for the host
tier; this is the second, with vLLM 0.32's semantics (`kv_offload/cpu/policies/
arc.py`) where they differ from the paper, so that the simulator can measure
kvswap's policy against what vLLM users actually run. No sink protection, no
residency window, no cost ranks; only the hard rule (a busy, lost or running
copy is skipped and keeps its place).

    T1  copies seen once (inserted, not reused since)     recency  } held: evict from
    T2  copies reused by a request while held here        frequency} T1 while |T1| >= p
    B1  content of copies that left T1 (ghosts, no data)  a hit: recency pays, p grows
    B2  content of copies that left T2                    a hit: frequency pays, p shrinks
    p   the adaptive target size of T1, 0..c

What the store's calls mean here:

    insert     a new copy enters T1 as its most recent. If its content is a ghost
               (B1 or B2: a copy of it left and it is stored again), p adapts by
               max(1, |B2|/|B1|) up or max(1, |B1|/|B2|) down, and the ghost goes.
               vLLM does the same (a store is no frequency hit: T1, not T2 as in
               the paper).
    update     a request reused the copy: the block gained its first reference
               (`referenced` False -> True) while the copy is ready here (not busy).
               A T1 copy moves to T2, a T2 copy becomes T2's most recent: vLLM's
               "ready chunks reused by a request move from T1 to T2 once". A sequence
               that keeps its reference across a pause and resume is no reuse, as
               vLLM does not count a request re-reading what it stored itself.
               Other updates only change whether the copy may leave.
    touch      the blocks became resident for a sequence: each is the most recent of
               its own list, tail first so a chain's head ends most recent (vLLM
               refreshes a request's keys tail to head); no promotion.
    evict(n)   n times: from T1 while its size (minus what this call took) >= int(p),
               else from T2, else from T1; victims' content joins B1 or B2. All n or
               none (None, nothing changed).
    remove     the copy left by another way (moved down, forgotten): its content joins
               the ghost list of its list all the same, as a departure.
    update of a key not held (a victim that stayed, or one the swapper took itself and
               ranks again): back into the list its ghost names, no adaptation.

Where it differs from vLLM's: vLLM applies a request's reuse and refreshes its
keys when the request finishes (`on_request_finished`); here a reuse counts
when the reference is taken and a refresh when the blocks become resident
(`touch`). A request sharing a block another still holds is not seen as a
reuse here (the facts say referenced already); vLLM counts it.

Capacity. vLLM's policy is built with the tier's size c (`cache_capacity`), and
so is this one when its builder knows it (`options.capacity_blocks`: the
store's slots of the tier, vLLM's host chunks, the NVMe slab's slots). c bounds
p (0..c) and each ghost list (|B1|, |B2| <= c, trimmed oldest first, as vLLM
bounds them). Built without a size, c is the most copies held at once so far:
a tier evicts only when it is nearly full, so that is close to its size by the
first eviction.

Ghosts are content keys (`BlockFacts.content_key`, the chain key), not block
ids: a dropped block is recomputed under a new id, and recognising that it
came back is what ARC learns from. A copy of a block not yet full has no
content key and leaves no ghost.

Every call is O(log n): T1 and T2 are `RecencyHeap`s (policy_recency.py), the
ghost lists ordered dicts, the sizes counters; `evict` walks past only the
candidates `protected` or `droppable_only` excludes, as LRU does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import NamedTuple

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.control.policy_recency import RecencyEntry, RecencyHeap


class ArcState(NamedTuple):
    """A view of the lists, oldest first (for tests and reports; O(n log n))."""

    t1: tuple[BlockKey, ...]
    t2: tuple[BlockKey, ...]
    b1: tuple[bytes, ...]
    b2: tuple[bytes, ...]
    target_t1_blocks: float  # p
    capacity_blocks: int  # c: the tier's size, or the most copies held at once so far


class ArcPolicy(EvictionPolicy):
    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._facts: dict[BlockKey, BlockFacts] = {}
        self._t1 = RecencyHeap()
        self._t2 = RecencyHeap()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1_blocks = 0.0
        self._capacity_blocks = options.capacity_blocks or 0
        self._num_candidates = 0

    def state(self) -> ArcState:
        return ArcState(
            tuple(self._t1.keys_oldest_first()), tuple(self._t2.keys_oldest_first()),
            tuple(self._b1), tuple(self._b2), self._target_t1_blocks, self._capacity_blocks,
        )  # fmt: skip

    # ------------------------------------------------------------------ the calls

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        if key in self._facts:
            self.update(key, facts)
            return
        content = facts.content_key
        if content is not None:
            self._adapt_to_ghost(content)
        self._hold(key, facts, self._t1)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        old = self._facts.get(key)
        if old is None:
            self._restore(key, facts)
            return
        self._num_candidates += facts.may_leave - old.may_leave
        self._facts[key] = facts
        if facts.referenced and not old.referenced and not facts.busy:  # a request reused it
            self._t1.discard(key)
            self._t2.use(key, candidate=facts.may_leave)
        else:
            self._list_of(key).set_candidate(key, candidate=facts.may_leave)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in reversed(list(keys)):
            facts = self._facts.get(key)
            if facts is not None:
                self._list_of(key).use(key, candidate=facts.may_leave)

    def remove(self, key: BlockKey) -> None:
        facts = self._facts.get(key)
        if facts is not None:
            self._release(key, from_t1=key in self._t1)
            self._trim_ghosts()

    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        passed: list[tuple[RecencyHeap, RecencyEntry]] = []  # excluded now: they stay

        def next_from(recency: RecencyHeap) -> RecencyEntry | None:
            while (entry := recency.pop_oldest()) is not None:
                key = entry[1]
                if key in protected or (droppable_only and not self._facts[key].droppable):
                    passed.append((recency, entry))
                else:
                    return entry
            return None

        picked: list[tuple[RecencyHeap, RecencyEntry]] = []
        t1_blocks = len(self._t1)  # T1's size as this call's victims leave it
        for _ in range(n):
            entry = next_from(self._t1) if t1_blocks >= int(self._target_t1_blocks) else None
            source = self._t1
            if entry is None:
                entry, source = next_from(self._t2), self._t2
            if entry is None:
                entry, source = next_from(self._t1), self._t1
            if entry is None:
                for recency, taken in (*passed, *picked):
                    recency.push_back(taken)
                return None
            t1_blocks -= source is self._t1
            picked.append((source, entry))
        for recency, entry in passed:
            recency.push_back(entry)
        for source, (_, key) in picked:
            self._release(key, from_t1=source is self._t1)
        self._trim_ghosts()
        return [key for _, (_, key) in picked]

    def num_candidates(self) -> int:
        return self._num_candidates

    def clear(self) -> None:
        """Forget every key, both ghost lists and p; the capacity learned stays (it is
        the tier's, not the keys')."""
        self._facts.clear()
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target_t1_blocks = 0.0
        self._num_candidates = 0

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:
        assert len(self._t1) + len(self._t2) == len(self._facts), "lists and facts out of step"
        for key in self._facts:
            assert (key in self._t1) != (key in self._t2), f"key {key} not in exactly one list"
            assert key in keys_with_copy, f"{self.tier.value}: key {key} held without a copy"
        candidates = [key for key, facts in self._facts.items() if facts.may_leave]
        assert self._num_candidates == len(candidates)
        self._t1.check_integrity([key for key in candidates if key in self._t1])
        self._t2.check_integrity([key for key in candidates if key in self._t2])
        assert not self._b1.keys() & self._b2.keys(), "a ghost in both B1 and B2"
        capacity = self._capacity_blocks
        assert len(self._facts) <= capacity, "more keys held than the capacity learned"
        assert len(self._b1) <= capacity and len(self._b2) <= capacity, "a ghost list past c"
        assert 0.0 <= self._target_t1_blocks <= capacity, f"p = {self._target_t1_blocks}"

    # ------------------------------------------------------------------ internal

    def _list_of(self, key: BlockKey) -> RecencyHeap:
        return self._t1 if key in self._t1 else self._t2

    def _hold(self, key: BlockKey, facts: BlockFacts, recency: RecencyHeap) -> None:
        self._facts[key] = facts
        self._num_candidates += facts.may_leave
        recency.use(key, candidate=facts.may_leave)
        self._capacity_blocks = max(self._capacity_blocks, len(self._facts))

    def _adapt_to_ghost(self, content: bytes) -> None:
        """A ghost hit: the content of a copy that left is stored again. p moves toward
        the list it left from, by the ratio of the ghost lists' sizes (at least 1)."""
        if content in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self._target_t1_blocks = min(self._target_t1_blocks + step, self._capacity_blocks)
            del self._b1[content]
        elif content in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self._target_t1_blocks = max(self._target_t1_blocks - step, 0.0)
            del self._b2[content]

    def _restore(self, key: BlockKey, facts: BlockFacts) -> None:
        """Hold again a key that left without its copy leaving (a victim that stayed):
        in the list its ghost names, as the most recent, without adapting p."""
        content = facts.content_key
        if content is not None and content in self._b2:
            del self._b2[content]
            self._hold(key, facts, self._t2)
            return
        if content is not None:
            self._b1.pop(content, None)
        self._hold(key, facts, self._t1)

    def _release(self, key: BlockKey, *, from_t1: bool) -> None:
        """`key` leaves its list; its content (if any) becomes that list's newest ghost."""
        facts = self._facts.pop(key)
        self._num_candidates -= facts.may_leave
        (self._t1 if from_t1 else self._t2).discard(key)
        content = facts.content_key
        if content is not None:
            ghosts, other = (self._b1, self._b2) if from_t1 else (self._b2, self._b1)
            other.pop(content, None)  # two blocks of one content: the last departure counts
            ghosts[content] = None
            ghosts.move_to_end(content)

    def _trim_ghosts(self) -> None:
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self._capacity_blocks:
                ghosts.popitem(last=False)
