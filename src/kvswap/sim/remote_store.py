"""The simulator's shared remote store: block keys in memory, shared by every engine.

    engine 0: swapper --lookup--> RemoteStoreView --+
              copy engine --read/write chunks--> ---+--> SharedRemoteStore
    engine 1: swapper --lookup--> RemoteStoreView --+    key -> (bytes, visible_s, expires_s)
              copy engine --read/write chunks--> ---+    LRU order, capacity in bytes

What it models of a Redis-protocol store:
- `maxmemory` with `allkeys-lru`: a write that would pass `capacity_bytes` first
  evicts the least recently used keys. The LRU here is exact (Redis samples a
  few keys per eviction, so it is only close to LRU), and only the values'
  bytes are counted (a real store also holds keys and per-entry overhead:
  give its `maxmemory` some 10 % more).
- What touches a key: a write (SET) and a read (GET). A lookup does not
  (Redis' EXISTS leaves the LRU clock alone), so a prefix that is only ever
  looked up ages out.
- An optional TTL (SET ... EX): a key expires `ttl_s` after its write on the
  virtual clock; a rewrite starts the TTL again; expired keys are dropped when
  next seen (Redis' lazy expiry).
- Written keys become visible when the modelled write completes: a lookup or
  a read at time t sees a key only if its write ended at or before t.

Several engines, each with its own virtual clock, share one store. The driver
of several engines always steps the engine whose clock is earliest, so an
engine looking up at time t is behind every other engine; before it looks, the
store asks each engine's copy engine to settle its writes up to t
(`attach`), so a write that ended by t is visible whether or not its engine
has polled since. Evictions happen in the order the simulation processes the
writes, which can be up to one step of the writing engine earlier in virtual
time than a real store would evict; that is the one approximation.

`SharedRemoteStore.holding` models instead kvswap's NVMe slab by key
(`kvswap.data.tiers.nvme_tier`) with the slab's own index, `KeySlots`: slots of
one block by key, evicting by the slab's policy (`nvme_eviction_policy`), a held
key (`hold` / `release`, counted per key; a key may be held before its write
lands) never a victim, a write that finds every key held failing. Such a store
has no TTL. With `local` too it is one engine's own (one view only) and says
what it evicted (`RemoteIndex.evicted_keys`), so the engine forgets those copies
as kvswap's NVMe by key lets it.

Counters are kept for the whole store and for each engine's view: keys found
and missed by lookups and reads, keys written, evictions, expirations, bytes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvswap.base.eviction_policy import EvictionPolicy
from kvswap.base.key_slots import KeySlots, NoSlot
from kvswap.base.remote_index import RemoteIndex
from kvswap.sim.clock import VirtualClock


@dataclass
class StoreCounters:
    """What happened in a store (or through one engine's view of it)."""

    lookups: int = 0
    lookup_hit_keys: int = 0  # keys a lookup reported present (the leading run)
    lookup_miss_keys: int = 0  # keys a lookup did not report (from the first absent one)
    lookup_wait_s: float = 0.0  # round trips the lookups cost on the engine's clock
    read_hit_keys: int = 0
    read_miss_keys: int = 0  # a fetched key that was gone (evicted, expired, never written)
    written_keys: int = 0
    already_present: int = 0  # written keys the store held already (another engine's)
    write_failed_keys: int = 0  # a value larger than the whole store, or every key held
    evictions: int = 0
    evicted_bytes: int = 0
    expirations: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out["lookup_wait_s"] = round(self.lookup_wait_s, 6)
        return out


@dataclass
class _Entry:
    num_bytes: int
    visible_s: float  # the write that made it ended then
    expires_s: float  # math.inf: no TTL


#: Settles one engine's remote writes up to a time (see `attach`).
Settle = Callable[[float], None]


class SharedRemoteStore:
    """Block keys -> presence, shared by every simulated engine (see the module)."""

    def __init__(self, capacity_bytes: int | None = None, *, ttl_s: float = 0.0):
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes < 1):
            raise ValueError(f"capacity_bytes must be >= 1 or None, got {capacity_bytes!r}")
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise ValueError(f"ttl_s must be a finite number >= 0, got {ttl_s!r}")
        self.local = False
        # The NVMe slab's index (`holding`); None: Redis's model (an LRU, a TTL).
        self._slots: KeySlots | None = None
        self._block_bytes = 0  # `holding`: every value's size
        self._evicted: list[bytes] = []  # local: keys evicted since the view last asked
        self._num_views = 0
        self.capacity_bytes = capacity_bytes  # None: unbounded
        self.ttl_s = ttl_s  # 0: keys never expire
        self.counters = StoreCounters()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        # Redis's model: least recent first. The slab's: the keys it holds, each visible
        # from when its write ended (which key leaves is the index's to say).
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._settlers: list[Settle] = []

    @classmethod
    def holding(
        cls, num_blocks: int, block_bytes: int, policy: EvictionPolicy, *, local: bool = False
    ) -> SharedRemoteStore:
        """kvswap's NVMe slab by key (module docstring): `num_blocks` blocks of
        `block_bytes`, evicting by `policy` (built for `num_blocks`), holding keys;
        `local`: one engine's own (`NvmeTier(local=True)`)."""
        store = cls(num_blocks * block_bytes)
        store._slots = KeySlots(num_blocks, policy, keep_evicted=True)
        store._block_bytes = block_bytes
        store.local = local
        return store

    @property
    def holds_keys(self) -> bool:
        """Whether it is the NVMe slab's model, which holds keys (`holding`)."""
        return self._slots is not None

    @property
    def capacity_blocks(self) -> int | None:
        """The slab's blocks (`holding`); None for Redis's model (sized in bytes)."""
        return None if self._slots is None else self._slots.num_slots

    @property
    def eviction_policy(self) -> EvictionPolicy | None:
        """The slab's policy (`holding`); None for Redis's model (an LRU)."""
        return None if self._slots is None else self._slots.policy

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # ------------------------------------------------------------------ holds

    def hold(self, keys: Sequence[bytes]) -> None:
        """Keep `keys` from eviction until as many `release`s (module docstring); a
        store that cannot hold keys ignores it."""
        if self._slots is not None:
            self._slots.hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        """End one `hold` of each of `keys` (ValueError for a key not held)."""
        if self._slots is not None:
            self._slots.release(keys)

    @property
    def num_held_keys(self) -> int:
        """Keys held now (stored or not yet)."""
        return 0 if self._slots is None else self._slots.num_held_keys

    def attach(self, settle: Settle) -> None:
        """Register an engine's copy engine: `settle(t_s)` records the writes it
        finished by `t_s` (never past its own clock)."""
        self._settlers.append(settle)

    def view(self, clock: VirtualClock, *, lookup_rtt_s: float = 0.0) -> RemoteStoreView:
        """One engine's `RemoteIndex` over this store, on that engine's clock (a local
        store has one only)."""
        if self.local and self._num_views:
            raise ValueError("a local store is one engine's own: it has one view only")
        self._num_views += 1
        return RemoteStoreView(self, clock, lookup_rtt_s=lookup_rtt_s)

    def take_evicted(self) -> list[bytes]:
        """The keys evicted since the last call (a local store's; otherwise none)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # ------------------------------------------------------------------ reads

    def lookup(self, keys: Sequence[bytes], now_s: float, counters: StoreCounters) -> int:
        """How many of `keys`, from the first, are present at `now_s` (no LRU touch)."""
        self._settle(now_s)
        found = 0
        for key in keys:
            if self._present(key, now_s) is None:
                break
            found += 1
        for tally in (self.counters, counters):
            tally.lookups += 1
            tally.lookup_hit_keys += found
            tally.lookup_miss_keys += len(keys) - found
        return found

    def read(self, keys: Sequence[bytes], now_s: float, counters: StoreCounters) -> list[int]:
        """Fetch `keys` at `now_s`; returns the positions of those absent. A key read
        becomes the most recently used."""
        self._settle(now_s)
        missing: list[int] = []
        num_bytes = 0
        slots = self._slots
        for index, key in enumerate(keys):
            entry = self._present(key, now_s)
            if entry is None:
                missing.append(index)
                continue
            if slots is None:
                self._entries.move_to_end(key)
            else:  # read at once: the slab's most recently used
                slots.begin_read(key)
                slots.end_read(key, good=True)
            num_bytes += entry.num_bytes
        for tally in (self.counters, counters):
            tally.read_hit_keys += len(keys) - len(missing)
            tally.read_miss_keys += len(missing)
            tally.bytes_read += num_bytes
        return missing

    # ----------------------------------------------------------------- writes

    def write(
        self,
        keys: Sequence[bytes],
        value_bytes: int,
        visible_s: float,
        counters: StoreCounters,
    ) -> list[int]:
        """Store `keys` (each `value_bytes`), visible from `visible_s`, evicting the
        least recently used keys past the capacity (the slab: its policy's victims);
        returns the positions that could not be stored (a value larger than the
        whole store, or with the slab every key held)."""
        if self._slots is not None:
            return self._write_slots(keys, value_bytes, visible_s, counters)
        failed: list[int] = []
        expires_s = visible_s + self.ttl_s if self.ttl_s > 0 else math.inf
        for index, key in enumerate(keys):
            if self.capacity_bytes is not None and value_bytes > self.capacity_bytes:
                failed.append(index)
                continue
            old = self._entries.pop(key, None)
            visible_s_of_key = visible_s
            if old is not None:
                self.used_bytes -= old.num_bytes
                if old.expires_s > visible_s:
                    # Readers may have seen the old value: the key stays visible.
                    visible_s_of_key = min(old.visible_s, visible_s)
                    for tally in (self.counters, counters):
                        tally.already_present += 1
            self._make_room(value_bytes, counters)
            self._entries[key] = _Entry(value_bytes, visible_s_of_key, expires_s)
            self.used_bytes += value_bytes
        self._wrote(len(keys), failed, value_bytes, counters)
        return failed

    def _write_slots(
        self, keys: Sequence[bytes], value_bytes: int, visible_s: float, counters: StoreCounters
    ) -> list[int]:
        """`write` to the slab's model: each key claims a slot of the index (a victim's
        when none is free), its write landing at once; a key stored already stays as
        it is (a block never changes), a key with no victim fails."""
        slots = self._slots
        assert slots is not None
        if value_bytes != self._block_bytes:
            raise ValueError(f"a {value_bytes}-byte value in a slab of {self._block_bytes}")
        failed: list[int] = []
        for index, key in enumerate(keys):
            slot = slots.claim(key)
            if slot is NoSlot.PRESENT:
                for tally in (self.counters, counters):
                    tally.already_present += 1
                continue
            if isinstance(slot, NoSlot):
                failed.append(index)  # every key is held
                continue
            slots.written(key)
            for evicted in slots.take_evicted():
                self._evict(self._entries.pop(evicted), counters)
                if self.local:
                    self._evicted.append(evicted)
            self._entries[key] = _Entry(value_bytes, visible_s, math.inf)
            self.used_bytes += value_bytes
        self._wrote(len(keys), failed, value_bytes, counters)
        return failed

    def _wrote(
        self, num_keys: int, failed: list[int], value_bytes: int, counters: StoreCounters
    ) -> None:
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        stored = num_keys - len(failed)
        for tally in (self.counters, counters):
            tally.written_keys += stored
            tally.write_failed_keys += len(failed)
            tally.bytes_written += stored * value_bytes

    def to_json(self) -> dict[str, object]:
        """The store's state and counters (the `remote_store` key of a summary)."""
        return {
            "capacity_bytes": self.capacity_bytes,
            "ttl_s": self.ttl_s,
            "num_keys": len(self),
            "used_bytes": self.used_bytes,
            "peak_used_bytes": self.peak_used_bytes,
            **self.counters.to_json(),
        }

    # --------------------------------------------------------------- internal

    def _settle(self, now_s: float) -> None:
        for settle in self._settlers:
            settle(now_s)

    def _present(self, key: bytes, now_s: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_s <= now_s:
            del self._entries[key]  # lazy expiry, as Redis does on access
            self.used_bytes -= entry.num_bytes
            self.counters.expirations += 1
            return None
        return entry if entry.visible_s <= now_s else None

    def _make_room(self, num_bytes: int, counters: StoreCounters) -> None:
        """Evict the least recently used keys until `num_bytes` fit (Redis's model; the
        caller checked the value fits the whole store)."""
        capacity = self.capacity_bytes
        if capacity is None:
            return
        while self._entries and self.used_bytes + num_bytes > capacity:
            self._evict(self._entries.popitem(last=False)[1], counters)

    def _evict(self, victim: _Entry, counters: StoreCounters) -> None:
        """`victim` (out of the entries now) is evicted: its bytes freed and counted."""
        self.used_bytes -= victim.num_bytes
        for tally in (self.counters, counters):
            tally.evictions += 1
            tally.evicted_bytes += victim.num_bytes


class RemoteStoreView(RemoteIndex):
    """One engine's window on the shared store: the `RemoteIndex` its swapper asks,
    and what its modelled copy engine reads and writes through. Counts what this
    engine did in `counters`. A lookup costs one round trip on the engine's clock
    (the engine's lookup blocks its loop for one pipelined request)."""

    def __init__(self, store: SharedRemoteStore, clock: VirtualClock, *, lookup_rtt_s: float):
        if not (math.isfinite(lookup_rtt_s) and lookup_rtt_s >= 0):
            raise ValueError(f"lookup_rtt_s must be a finite number >= 0, got {lookup_rtt_s!r}")
        self.store = store
        self.clock = clock
        self.lookup_rtt_s = lookup_rtt_s
        self.counters = StoreCounters()

    def lookup(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        found = self.store.lookup(keys, self.clock.now_s, self.counters)
        self.clock.advance(self.lookup_rtt_s)
        self.counters.lookup_wait_s += self.lookup_rtt_s
        self.store.counters.lookup_wait_s += self.lookup_rtt_s
        return found

    @property
    def available(self) -> bool:
        return True  # the modelled store never goes down

    @property
    def holds_keys(self) -> bool:
        return self.store.holds_keys

    def hold(self, keys: Sequence[bytes]) -> None:
        self.store.hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        self.store.release(keys)

    @property
    def local(self) -> bool:
        return self.store.local

    def evicted_keys(self) -> Sequence[bytes]:
        return self.store.take_evicted()

    @property
    def capacity_blocks(self) -> int | None:
        return self.store.capacity_blocks

    def attach(self, settle: Settle) -> None:
        self.store.attach(settle)

    def read(self, keys: Sequence[bytes], now_s: float) -> list[int]:
        return self.store.read(keys, now_s, self.counters)

    def write(self, keys: Sequence[bytes], value_bytes: int, visible_s: float) -> list[int]:
        return self.store.write(keys, value_bytes, visible_s, self.counters)
