"""Keys in last-use order, with a min-heap of those that may leave now: O(log n) a call.

The recency list of plain LRU (one of these) and of ARC (one per list, T1 and
T2). Every key held has a stamp, its last use; a candidate (a key that may
leave now) also has a heap entry carrying that stamp. An entry stands for its
key only while that stamp is the key's queued one: entries left behind by a
use, a removal or a key that stopped being a candidate are skipped when they
surface, and the heap is rebuilt once they outnumber the keys. A key that stops
being a candidate keeps its stamp, so it rejoins at its old place in the order.

    held:    a:5  b:7  c:9  d:12        (stamps; d most recently used)
    heap:    (5,a) (9,c) (12,d) (7,b)*   * left behind: b is busy now, not queued
    pop_oldest() -> (5, a); then (9, c): b is skipped, and rejoins at 7 when it may leave
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection

from kvswap.base.eviction_policy import BlockKey

#: A heap entry: (stamp, key). Stamps are unique, so keys are never compared.
RecencyEntry = tuple[int, BlockKey]


class RecencyHeap:
    """The keys of one recency list; the least recently used candidate first."""

    def __init__(self) -> None:
        self._used: dict[BlockKey, int] = {}  # key -> stamp of its last use
        self._queued: dict[BlockKey, int] = {}  # candidate -> stamp of its heap entry
        self._heap: list[RecencyEntry] = []
        self._stamps = itertools.count()

    def __len__(self) -> int:
        return len(self._used)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._used

    def use(self, key: BlockKey, *, candidate: bool) -> None:
        """`key` (held from now on) is the most recently used; `candidate`: may leave."""
        self._used[key] = next(self._stamps)
        self.set_candidate(key, candidate=candidate)

    def set_candidate(self, key: BlockKey, *, candidate: bool) -> None:
        """Whether held `key` may leave now; its place in the order is kept."""
        if not candidate:
            self._queued.pop(key, None)
            return
        stamp = self._used[key]
        if self._queued.get(key) != stamp:
            self._queued[key] = stamp
            heapq.heappush(self._heap, (stamp, key))
            if len(self._heap) > 2 * len(self._used) + 64:
                self._rebuild()

    def discard(self, key: BlockKey) -> None:
        """`key` leaves the list (a key not held is ignored)."""
        self._used.pop(key, None)
        self._queued.pop(key, None)

    def pop_oldest(self) -> RecencyEntry | None:
        """The least recently used candidate's entry, taken off the heap (it is held
        still, but not a candidate until `push_back` or `set_candidate`); None: none."""
        heap, queued = self._heap, self._queued
        while heap:
            entry = heapq.heappop(heap)
            stamp, key = entry
            if queued.get(key) == stamp:
                del queued[key]
                return entry
        return None

    def push_back(self, entry: RecencyEntry) -> None:
        """Return an entry `pop_oldest` gave, at its old place."""
        stamp, key = entry
        self._queued[key] = stamp
        heapq.heappush(self._heap, entry)

    def keys_oldest_first(self) -> list[BlockKey]:
        """Every key held, least recently used first (O(n log n): for tests and views)."""
        return sorted(self._used, key=self._used.__getitem__)

    def clear(self) -> None:
        self._used.clear()
        self._queued.clear()
        self._heap.clear()

    def check_integrity(self, candidates: Collection[BlockKey]) -> None:
        """Exactly `candidates` are queued, each at its last-use stamp."""
        assert self._queued.keys() == set(candidates), "queued keys are not the candidates"
        for key, stamp in self._queued.items():
            assert self._used.get(key) == stamp, f"candidate {key} queued at an old stamp"

    def _rebuild(self) -> None:
        self._heap = [(stamp, key) for key, stamp in self._queued.items()]
        heapq.heapify(self._heap)
