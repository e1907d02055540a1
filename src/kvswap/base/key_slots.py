"""A keyed tier's slots by block key, evicting by policy: the NVMe slab's index.

    index    key -> (slot, state, readers)      WRITING: being stored, not yet found
                                                READY:   written; found by lookup and loads
                                                BAD:     failed a read; dropped with its
                                                         last reader
    free     slots no key takes
    holds    key -> holds not yet released (a key may be held before its store lands)
    policy   the eviction policy over the keys stored (built by the caller for
             `num_slots`: `kvswap.control.policy.named_policy`)
    evicted  the victims' keys not yet taken (kept only when asked: a tier of this
             process, whose owner drops those copies)

A key's store claims a slot (`claim`): none if it is stored already (a block
never changes), a free one, else the policy's victim's (its cheapest key). A
key being written or read is busy and never a victim, nor is a held one (the
hard rule); with every key busy or held there is no slot ("full").

The policy sees each key as a cache entry whose only copy is here
(`BlockFacts`), busy while it is written or read, referenced and busy while
held; a good read makes the key the most recently used (`touch`), so under
"kvswap" and "lru" alike the least recently stored or loaded key leaves first.

One index, two users: kvswap's NVMe slab (`kvswap.data.tiers.nvme_tier.NvmeTier`
adds the disk, a lock and its counters) and the simulator's model of it
(`kvswap.sim.remote_store`), so both evict the same keys by the same policy.
Not thread-safe: the caller locks.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvswap.base.eviction_policy import BlockFacts, EvictionPolicy


class _State(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    BAD = "bad"


class NoSlot(enum.Enum):
    """Why `KeySlots.claim` hands out no slot."""

    PRESENT = "present"  # the key is stored already: nothing to write
    FULL = "full: every key is being read, written or held"  # no victim
    DROPPING = "its old value failed a read and is being dropped"


@dataclass
class _Entry:
    slot: int
    state: _State = _State.WRITING
    num_readers: int = 0

    def facts(self, held: bool) -> BlockFacts:
        busy = held or self.state is not _State.READY or self.num_readers > 0
        return BlockFacts(referenced=held, running=False, sink=False, busy=busy,
                          clean=False, ready_above=False, lost=False)  # fmt: skip


class KeySlots:
    """`num_slots` slots by key, ranked by `policy` (module docstring); `keep_evicted`:
    the victims' keys are kept for `take_evicted`."""

    def __init__(self, num_slots: int, policy: EvictionPolicy, *, keep_evicted: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.policy = policy
        self._keep_evicted = keep_evicted
        self._index: dict[bytes, _Entry] = {}
        self._holds: Counter[bytes] = Counter()  # key -> holds not yet released
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._evicted: list[bytes] = []
        self.num_evicted = 0  # victims since the index was made

    # --- questions ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are READY."""
        for count, key in enumerate(keys):
            entry = self._index.get(key)
            if entry is None or entry.state is not _State.READY:
                return count
        return len(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        """Keys held (being written included)."""
        return len(self._index)

    @property
    def num_held_keys(self) -> int:
        """Keys held now (stored or not yet)."""
        return len(self._holds)

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding `key`; None when it is not held."""
        entry = self._index.get(key)
        return None if entry is None else entry.slot

    # --- holds --------------------------------------------------------------------------

    def hold(self, keys: Iterable[bytes]) -> None:
        """Keep `keys` from eviction until as many `release`s."""
        for key in keys:
            self._holds[key] += 1
            if self._holds[key] == 1:
                self._rank(key)

    def release(self, keys: Sequence[bytes]) -> None:
        """End one `hold` of each of `keys`; ValueError (nothing changed) for a key
        released more often than held."""
        absent = [key for key, n in Counter(keys).items() if self._holds[key] < n]
        if absent:
            raise ValueError(f"release of {len(absent)} key(s) not held")
        for key in keys:
            self._holds[key] -= 1
            if self._holds[key] > 0:
                continue
            del self._holds[key]
            self._rank(key)

    # --- stores and loads ---------------------------------------------------------------

    def claim(self, key: bytes) -> int | NoSlot:
        """A slot for `key`, now WRITING: a free one, or the policy's victim's (its key
        forgotten, kept for `take_evicted` if asked); or why there is none."""
        present = self._index.get(key)
        if present is not None:
            return NoSlot.DROPPING if present.state is _State.BAD else NoSlot.PRESENT
        if self._free:
            slot = self._free.pop()
        else:
            victims = self.policy.evict(1)
            if victims is None:
                return NoSlot.FULL
            victim_key = victims[0]
            assert isinstance(victim_key, bytes), f"the policy evicted {victim_key!r}"
            victim = self._index.pop(victim_key)
            ready = victim.state is _State.READY and victim.num_readers == 0
            assert ready and victim_key not in self._holds, (
                f"the policy evicted a busy or held key ({victim})"
            )
            slot = victim.slot
            self.num_evicted += 1
            if self._keep_evicted:
                self._evicted.append(victim_key)
        entry = self._index[key] = _Entry(slot)
        self.policy.insert(key, entry.facts(key in self._holds))
        return slot

    def written(self, key: bytes) -> None:
        """`key`'s store landed: READY (found by lookups and loads)."""
        self._index[key].state = _State.READY
        self._rank(key)

    def begin_read(self, key: bytes) -> int | None:
        """`key`'s slot, now read (busy: never a victim); None unless it is READY."""
        entry = self._index.get(key)
        if entry is None or entry.state is not _State.READY:
            return None
        entry.num_readers += 1
        self._rank(key)
        return entry.slot

    def end_read(self, key: bytes, *, good: bool) -> None:
        """A read of `key` ended; `good` False: its value failed its check, so no lookup
        or load finds it from now on, and it is dropped with its last reader."""
        entry = self._index[key]
        entry.num_readers -= 1
        if not good:
            entry.state = _State.BAD
        if entry.state is _State.BAD:
            if entry.num_readers == 0:
                self.drop(key)
            return
        self._rank(key)
        self.policy.touch((key,))  # the most recently used, whatever the policy

    def drop(self, key: bytes) -> None:
        """Forget `key` (a store that failed, a value that failed its check)."""
        entry = self._index.pop(key)
        self.policy.remove(key)
        self._free.append(entry.slot)

    def take_evicted(self) -> list[bytes]:
        """The victims' keys since the last call, oldest first (with `keep_evicted`)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is either free or held by one key, and
        the policy ranks exactly the keys stored."""
        held = [entry.slot for entry in self._index.values()]
        assert len(set(held)) == len(held), "two keys share a slot"
        assert not set(held) & set(self._free), "a held slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "a slot went missing"
        self.policy.check_integrity(self._index.keys())

    def _rank(self, key: bytes) -> None:
        """The policy hears `key`'s facts now (a key not stored, or BAD: nothing)."""
        entry = self._index.get(key)
        if entry is not None and entry.state is not _State.BAD:
            self.policy.update(key, entry.facts(key in self._holds))
