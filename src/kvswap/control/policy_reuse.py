"""Reuse ranking: the copy whose next use is furthest away leaves first.

Belady's rule, the optimal one, evicts the block used furthest in the future. A KV
tier below the device sees conversations: a session's blocks come back when its next
turn arrives, a think time after its last turn ended. When the working set is
several times the tier, a recency order (LRU, and ARC's lists) evicts each session
just before it would come back, and hits little. This policy predicts each copy's
next use from its own history and evicts by that prediction, in five classes:

    dead       unreferenced, and idle longer than `DEAD_GAPS` return gaps: a
               session that ended. First, the oldest first.
    once/ref   used by one request, which still runs (its blocks are on the device):
               its next use is after the request ends and a think time. The newest
               first.
    once       used by one request, which ended. The newest first: of two sessions
               that ended a turn, the earlier comes back sooner (`once=oldest`: the
               oldest first, below).
    once/sink  as once, but among a running request's first blocks (`facts.sink`):
               the head of a conversation, what its next turn finds first.
    reused     used by several requests: its next use is predicted at its last use
               plus its own mean gap between uses, and the furthest goes first. A
               shared prefix (a system prompt) is reused often, so it stays.

A use is the copy's insertion, or a request starting to reference it (a reference
rising from none); `touch` refreshes the last use. The clock is `advance`'s step.
A first-reuse gap is insertion to first reuse. Two kinds mix in them: a session
coming back after its think time, and a prefix that another request takes up
again a few steps after its copy arrived (a system prompt between two requests).
When the tier is small the second kind is most of what is seen (only copies
still held when reused give a gap), and a median of all gaps is a few steps: a
dead line at a few medians then calls every waiting session dead, and the tier
turns over like LRU. So the return gap is a high quantile (`GAP_QUANTILE`) of
the last `GAP_WINDOW` gaps, where the sessions' returns are; until one gap is
seen nothing is dead. On `policy_hit_rates.py` this moved `reuse` from 0.918 to
1.04 of the better of LRU and ARC with the working set 8x the tier, and from
0.944 to 0.98 at 1x (a median and 3 gaps before).

Two parameters (`reuse(once=oldest, dead_gaps=1.2)`, `PARAMETERS`):
`dead_gaps` (1.5) moves the dead line; `once=oldest` evicts the once class
oldest first. Newest first keeps a stable set of sessions until they return,
which is what a tier several times smaller than the working set can do; a tier
a third of the working set or more holds many sessions until they return
anyway, and there the oldest are the likelier dead. In `policy_hit_rates.py`'s
chat on seeds 0, 1 and 2 (prefix-hit tokens over the better of LRU and ARC,
working set over the tier):

    order     8x          4x          3x          2x          1x
    newest    1.04-1.07   1.05-1.08   1.03-1.05   1.01        0.92-0.98
    oldest    0.93-0.97   1.05        1.04-1.05   1.01-1.03   1.01-1.02

The default stays newest first. No signal tried chose between them by itself
(ghost lists of each order's victims, miniature caches of a sample of keys: both
saw as many returns at every size).

Each class is a heap with lazy deletion (an entry carries the key's version; a
changed key pushes a new one) of the copies that may leave now: `evict` costs
O(log n) per victim and per stale entry, and, with `droppable_only`, per copy it
looks past that only a transfer could move (a paused sequence's only copy).

On `host_tier_replay.py` (vLLM's host tier replayed at its manager level), this
ranking hits more than Belady's rule with the future read off an unlimited run, with
or without admission, at every working set from 8x down to 1.5x the tier, on the
chat and the agents (1.13 against 1.06 of the better of LRU and ARC on the chat at
4x), and less at 1x: that oracle counts a block needed even where the device's
prefix cache serves it (docs/benchmarks.md). Torch-free, like the rest of `control/`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier

#: A copy idle this many return gaps is taken for dead.
DEAD_GAPS = 1.5
#: The quantile of the recent first-reuse gaps taken for the return gap.
GAP_QUANTILE = 0.9
#: How many recent first-reuse gaps the quantile is taken over.
GAP_WINDOW = 512
#: The classes after the dead, in eviction order (module docstring): their heaps' indexes.
ONCE_REFERENCED, ONCE, ONCE_SINK, REUSED = range(4)
#: The heap of the unreferenced copies by last use, where the dead are found.
IDLE = -1

_Entry = tuple[float, int, BlockKey]  # (order, version, key): lowest leaves first


@dataclass
class _Use:
    facts: BlockFacts
    first_step: int
    last_step: int
    uses: int
    version: int = 0

    def class_and_order(self, once_oldest: bool) -> tuple[int, float]:
        """Which heap the copy is in, and its order there (lowest leaves first)."""
        if self.uses >= 2:
            gap = (self.last_step - self.first_step) / (self.uses - 1)
            return REUSED, -(self.last_step + gap)
        if self.facts.sink:
            return ONCE_SINK, -self.last_step
        if self.facts.referenced:
            return ONCE_REFERENCED, -self.last_step
        return ONCE, (self.last_step if once_oldest else -self.last_step)


def _once_order(text: str) -> str:
    if text not in ("newest", "oldest"):
        raise ValueError("allowed: 'newest' (the default) or 'oldest'")
    return text


def _return_gaps(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"allowed: a number of return gaps > 0 (default {DEAD_GAPS})")
    return value


class ReusePolicy(EvictionPolicy):
    """Evicts by predicted next use (module docstring)."""

    PARAMETERS: ClassVar[Mapping[str, Callable[[str], object]]] = {
        "once": _once_order, "dead_gaps": _return_gaps,
    }  # fmt: skip

    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self._once_oldest = self.parameter("once", "newest") == "oldest"
        dead_gaps = self.parameter("dead_gaps", DEAD_GAPS)
        assert isinstance(dead_gaps, float)
        self._dead_gaps = dead_gaps
        self._held: dict[BlockKey, _Use] = {}
        self._heaps: list[list[_Entry]] = [[] for _ in range(REUSED + 1)]  # by class
        self._idle: list[_Entry] = []  # unreferenced copies by last use: the dead check
        self._step = 0
        self._versions = 0  # the last version given to any entry
        self._gaps: deque[int] = deque(maxlen=GAP_WINDOW)
        self._dead_after_steps: float | None = None  # from the gaps; None: not yet
        self._num_candidates = 0

    # --- the calls ---------------------------------------------------------------------

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        if key in self._held:
            self.update(key, facts)
            return
        held = self._held[key] = _Use(facts, self._step, self._step, 1)
        self._num_candidates += facts.may_leave
        self._push(key, held)

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        held = self._held.get(key)
        if held is None:
            self.insert(key, facts)
            return
        if facts.referenced and not held.facts.referenced:  # a request (re)uses it
            if held.uses == 1:
                self._gaps.append(self._step - held.last_step)
                self._dead_after_steps = None
            held.uses += 1
            held.last_step = self._step
        self._num_candidates += facts.may_leave - held.facts.may_leave
        held.facts = facts
        self._push(key, held)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            held = self._held.get(key)
            if held is not None and held.last_step != self._step:
                held.last_step = self._step
                self._push(key, held)

    def remove(self, key: BlockKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._num_candidates -= held.facts.may_leave

    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        wanted = _Wanted(self._held, protected, droppable_only)
        victims: list[BlockKey] = []
        passed: list[tuple[int, _Entry]] = []  # live entries not taken: pushed back after
        dead_before = self._step - self._dead_after()
        for heap_id in (IDLE, *range(len(self._heaps))):
            heap = self._heap(heap_id)
            while len(victims) < n and heap:
                entry = heap[0]
                if heap_id == IDLE and entry[0] >= dead_before:
                    break  # the oldest idle copy is not dead: none is
                heapq.heappop(heap)
                state = wanted.state(entry, idle=heap_id == IDLE)
                if state is _STALE:
                    continue
                passed.append((heap_id, entry))
                if state is _TAKEN:
                    victims.append(entry[2])
                    wanted.taken.add(entry[2])
        for heap_id, entry in passed:  # a victim's entries go stale with its removal
            heapq.heappush(self._heap(heap_id), entry)
        if len(victims) < n:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def admit(self, num_offered: int, num_free: int) -> int:
        """New copies are used once so far and the newest of them: each would be the
        next victim after the dead. So take what free slots and dead copies make room
        for, and no more: a new copy never displaces a live one only to leave next (and
        a writer that stores less copies less)."""
        if num_offered <= num_free:
            return num_offered
        return min(num_offered, num_free + self._num_dead(num_offered - num_free))

    def num_candidates(self) -> int:
        return self._num_candidates

    def clear(self) -> None:
        self._held.clear()
        for heap in (*self._heaps, self._idle):
            heap.clear()
        self._num_candidates = 0

    def advance(self, step: int) -> None:
        self._step = step

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:
        candidates = sum(held.facts.may_leave for held in self._held.values())
        assert candidates == self._num_candidates, "candidate count out of step"
        live = {(key, held.version) for key, held in self._held.items() if held.facts.may_leave}
        in_heaps = {(entry[2], entry[1]) for heap in self._heaps for entry in heap}
        assert live <= in_heaps, "a candidate is in no class heap"
        for key, held in self._held.items():
            assert key in keys_with_copy, f"{self.tier.value}: key {key} held without a copy"
            assert held.first_step <= held.last_step and held.uses >= 1

    # --- internal ----------------------------------------------------------------------

    def _heap(self, heap_id: int) -> list[_Entry]:
        return self._idle if heap_id == IDLE else self._heaps[heap_id]

    def _push(self, key: BlockKey, held: _Use) -> None:
        """The copy's ranking inputs changed: its new entries; the old ones go stale. The
        version is the policy's, not the key's: a key removed and inserted again must
        not bring its old entries back to life. A copy that may not leave now (busy, a
        running sequence's) gets no entry until a change lets it: `evict` would pop it
        and push it back at every call, a scan of the tier where most copies are such
        (a device tier of running sequences)."""
        self._versions += 1
        held.version = self._versions
        if not held.facts.may_leave:
            return
        heap_id, order = held.class_and_order(self._once_oldest)
        heapq.heappush(self._heaps[heap_id], (order, held.version, key))
        if not held.facts.referenced:
            heapq.heappush(self._idle, (float(held.last_step), held.version, key))
        if sum(map(len, self._heaps)) + len(self._idle) > 8 * len(self._held) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the stale entries (lazy deletion leaves them until popped)."""
        for heap in (*self._heaps, self._idle):
            heap[:] = [e for e in heap if (h := self._held.get(e[2])) and h.version == e[1]]
            heapq.heapify(heap)

    def _num_dead(self, at_most: int) -> int:
        """How many dead copies may leave now, counting up to `at_most` (the idle heap's
        head is popped and pushed back; stale entries found on the way are dropped)."""
        dead_before = self._step - self._dead_after()
        found: set[BlockKey] = set()
        kept: list[_Entry] = []
        idle = self._idle
        while idle and len(found) < at_most and idle[0][0] < dead_before:
            entry = heapq.heappop(idle)
            held = self._held.get(entry[2])
            if held is None or held.version != entry[1] or held.facts.referenced:
                continue  # stale
            kept.append(entry)
            if held.facts.may_leave:
                found.add(entry[2])
        for entry in kept:
            heapq.heappush(idle, entry)
        return len(found)

    def _dead_after(self) -> float:
        """Idle steps past which an unreferenced copy is dead (computed once per new gap)."""
        if not self._gaps:
            return float("inf")
        if self._dead_after_steps is None:
            ordered = sorted(self._gaps)
            gap = ordered[min(len(ordered) - 1, int(GAP_QUANTILE * len(ordered)))]
            self._dead_after_steps = self._dead_gaps * max(1.0, gap)
        return self._dead_after_steps


_STALE, _PASSED, _TAKEN = object(), object(), object()


class _Wanted:
    """Which popped entries `evict` takes: live, may leave, not protected, droppable if
    asked, and not taken already (a copy has entries in two heaps)."""

    def __init__(
        self,
        held: dict[BlockKey, _Use],
        protected: Collection[BlockKey],
        droppable_only: bool,
    ) -> None:
        self.held = held
        self.protected = protected
        self.droppable_only = droppable_only
        self.taken: set[BlockKey] = set()

    def state(self, entry: _Entry, idle: bool) -> object:
        key = entry[2]
        use = self.held.get(key)
        if use is None or use.version != entry[1] or (idle and use.facts.referenced):
            return _STALE
        facts = use.facts
        ok = facts.may_leave and key not in self.protected and key not in self.taken
        if ok and (not self.droppable_only or facts.droppable):
            return _TAKEN
        return _PASSED
