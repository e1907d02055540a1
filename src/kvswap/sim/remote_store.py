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

With `holds_keys` it models instead a keyed tier that evicts by its own LRU and
can hold keys (kvswap's NVMe by key, `kvswap.data.tiers.nvme_tier`): a held key
(`hold` / `release`, counted per key; a key may be held before its write lands)
leaves the LRU order until its last release, is never evicted, and a write that
finds every key held fails. Such a store has no TTL. With `local` too it is one
engine's own (one view only) and says what it evicted (`RemoteIndex.evicted_keys`),
so the engine forgets those copies as kvswap's NVMe by key lets it.

Counters are kept for the whole store and for each engine's view: keys found
and missed by lookups and reads, keys written, evictions, expirations, bytes.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

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

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        ttl_s: float = 0.0,
        holds_keys: bool = False,
        local: bool = False,
    ):
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes < 1):
            raise ValueError(f"capacity_bytes must be >= 1 or None, got {capacity_bytes!r}")
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise ValueError(f"ttl_s must be a finite number >= 0, got {ttl_s!r}")
        if holds_keys and ttl_s > 0:
            raise ValueError(f"a store that holds keys has no TTL, got ttl_s={ttl_s!r}")
        if local and not holds_keys:
            raise ValueError("a local store (one engine's own) holds keys: give holds_keys=True")
        self.holds_keys = holds_keys
        self.local = local
        self._evicted: list[bytes] = []  # local: keys evicted since the view last asked
        self._num_views = 0
        self.capacity_bytes = capacity_bytes  # None: unbounded
        self.ttl_s = ttl_s  # 0: keys never expire
        self.counters = StoreCounters()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self._held_entries: dict[bytes, _Entry] = {}  # stored and held: out of the LRU order
        self._holds: Counter[bytes] = Counter()  # key -> holds not yet released
        self._settlers: list[Settle] = []

    def __len__(self) -> int:
        return len(self._entries) + len(self._held_entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries or key in self._held_entries

    # ------------------------------------------------------------------ holds

    def hold(self, keys: Sequence[bytes]) -> None:
        """Keep `keys` from eviction until as many `release`s (module docstring)."""
        if not self.holds_keys:
            return
        for key in keys:
            self._holds[key] += 1
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._held_entries[key] = entry

    def release(self, keys: Sequence[bytes]) -> None:
        """End one `hold` of each of `keys`; a key left unheld is the most recently used."""
        if not self.holds_keys:
            return
        for key in keys:
            if self._holds[key] < 1:
                raise ValueError("release of a key not held")
            self._holds[key] -= 1
            if self._holds[key] == 0:
                del self._holds[key]
                entry = self._held_entries.pop(key, None)
                if entry is not None:
                    self._entries[key] = entry

    @property
    def num_held_keys(self) -> int:
        """Keys held now (stored or not yet)."""
        return len(self._holds)

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
        for index, key in enumerate(keys):
            entry = self._present(key, now_s)
            if entry is None:
                missing.append(index)
                continue
            if key in self._entries:  # a held key is out of the LRU order
                self._entries.move_to_end(key)
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
        least recently used keys past the capacity; returns the positions that
        could not be stored (a value larger than the whole store)."""
        failed: list[int] = []
        expires_s = visible_s + self.ttl_s if self.ttl_s > 0 else math.inf
        for index, key in enumerate(keys):
            if self.capacity_bytes is not None and value_bytes > self.capacity_bytes:
                failed.append(index)
                continue
            old = self._entries.pop(key, None)
            if old is None:
                old = self._held_entries.pop(key, None)
            visible_s_of_key = visible_s
            if old is not None:
                self.used_bytes -= old.num_bytes
                if old.expires_s > visible_s:
                    # Readers may have seen the old value: the key stays visible.
                    visible_s_of_key = min(old.visible_s, visible_s)
                    for tally in (self.counters, counters):
                        tally.already_present += 1
            if not self._make_room(value_bytes, counters):
                failed.append(index)  # every key left is held
                continue
            entry = _Entry(value_bytes, visible_s_of_key, expires_s)
            if key in self._holds:
                self._held_entries[key] = entry
            else:
                self._entries[key] = entry
            self.used_bytes += value_bytes
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        stored = len(keys) - len(failed)
        for tally in (self.counters, counters):
            tally.written_keys += stored
            tally.write_failed_keys += len(failed)
            tally.bytes_written += stored * value_bytes
        return failed

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
            held = self._held_entries.get(key)  # never expires: no TTL with holds
            return held if held is not None and held.visible_s <= now_s else None
        if entry.expires_s <= now_s:
            del self._entries[key]  # lazy expiry, as Redis does on access
            self.used_bytes -= entry.num_bytes
            self.counters.expirations += 1
            return None
        return entry if entry.visible_s <= now_s else None

    def _make_room(self, num_bytes: int, counters: StoreCounters) -> bool:
        """Evict the least recently used unheld keys until `num_bytes` fit; False when
        they do not even then (every key left is held)."""
        capacity = self.capacity_bytes
        if capacity is None:
            return True
        while self._entries and self.used_bytes + num_bytes > capacity:
            key, victim = self._entries.popitem(last=False)
            self.used_bytes -= victim.num_bytes
            if self.local:
                self._evicted.append(key)
            for tally in (self.counters, counters):
                tally.evictions += 1
                tally.evicted_bytes += victim.num_bytes
        return self.used_bytes + num_bytes <= capacity


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

    def attach(self, settle: Settle) -> None:
        self.store.attach(settle)

    def read(self, keys: Sequence[bytes], now_s: float) -> list[int]:
        return self.store.read(keys, now_s, self.counters)

    def write(self, keys: Sequence[bytes], value_bytes: int, visible_s: float) -> list[int]:
        return self.store.write(keys, value_bytes, visible_s, self.counters)
