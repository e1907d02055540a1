"""The NVMe slab as a keyed secondary tier: `DiskPool` slots by block key, evicting by policy.

    index    key -> (slot, state, readers)      WRITING: being stored, not yet found
                                                READY:   written; found by lookup and loads
                                                BAD:     failed a read; dropped with its
                                                         last reader
    free     slots no key takes
    holds    key -> holds not yet released (a key may be held before its store lands)
    policy   the eviction policy the caller built for the NVMe tier (the adapters:
             `kvswap.control.policy.named_policy`) over the keys stored; one lock
             guards all four, and the copies run outside it

A store job (on a store lane), key by key:
    stored already (READY, WRITING)    succeeds without a copy: a block never changes
    a free slot, else the policy's     WRITING, written, READY. The victim is the
    victim (its cheapest key)          least valuable key; one being written or read
                                       is busy and never a victim (the hard rule)
    no victim (every key busy, held)   that key fails: "full", counted `no_room_blocks`
    a write that fails (ENOSPC, EIO)   that key fails; its slot is free again

A held key is never a victim: with every key held or busy, a store fails "full".
A tier opened `local` (kvswap's engine's own NVMe) keeps its victims' keys until
`evicted_keys()` takes them, so the engine drops those copies; under vLLM and
SGLang, whose tiering asks by lookup, it keeps none.

A load job (on a load lane), key by key: a key not READY fails ("missing");
a READY one is read into its host slot and checked against the CRC written
with it (`DiskPool.read_slot`): a mismatch (or a read error) fails the key and
drops the entry (`corrupt_blocks`), so a corrupt value is a miss, never bytes
served. A good read makes the key the most recently used.

The policy sees each key as a cache entry whose only copy is here
(`BlockFacts`), busy while it is written or read, referenced and busy while
held; under "kvswap" and "lru" alike the least recently stored or loaded key
leaves first. The tier owns the `DiskPool`: `close()` closes it (the slab file
is removed unless persisted).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvswap.base.eviction_policy import BlockFacts, EvictionPolicy
from kvswap.data.disk_pool import DiskPool, DiskSlotError
from kvswap.data.tiers.base import HostSlots, JobResult, TransferJob, as_host_slots, job_result
from kvswap.data.tiers.lanes import LaneTier, Totals


class _State(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    BAD = "bad"


class _NoSlot(enum.Enum):
    """Why `_claim` hands out no slot."""

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


@dataclass(frozen=True)
class NvmeTierStats:
    """Counts since the tier opened, in blocks unless the name says otherwise."""

    hits_blocks: int = 0  # loaded intact
    misses_blocks: int = 0  # loads of a key not held (or still being written)
    corrupt_blocks: int = 0  # loads that failed the CRC or the read: entry dropped
    written_blocks: int = 0
    already_present: int = 0  # stores of a key stored already: nothing written
    failed_writes: int = 0  # keys a store did not store, whatever the reason
    no_room_blocks: int = 0  # ... of them because every key was busy or held
    evicted_blocks: int = 0  # keys the policy gave up to make room
    nvme_to_cpu_bytes: int = 0
    cpu_to_nvme_bytes: int = 0


class NvmeTier(LaneTier):
    """Blocks by key in the slots of one `DiskPool`, at most `disk.num_slots` of them."""

    def __init__(
        self,
        host_slots: memoryview | HostSlots,
        disk: DiskPool,
        *,
        policy: EvictionPolicy,
        num_read_lanes: int = 1,
        num_write_lanes: int = 1,
        local: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        slots = as_host_slots(host_slots)
        if disk.block_bytes != slots.shape[1]:
            raise ValueError(
                f"NVMe slab blocks are {disk.block_bytes} bytes, host slots {slots.shape[1]}; "
                "they must match"
            )
        self.disk = disk
        self._policy = policy
        self._lock = threading.Lock()  # guards the index, the free slots and the policy
        self._index: dict[bytes, _Entry] = {}
        self._holds: Counter[bytes] = Counter()  # key -> holds not yet released
        self._local = local
        self._evicted: list[bytes] = []  # local: victims' keys not yet taken
        self._free = list(range(disk.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._totals = Totals(NvmeTierStats())
        super().__init__(
            slots, name="nvme", num_load_lanes=num_read_lanes, num_store_lanes=num_write_lanes,
            clock=clock,
        )  # fmt: skip

    # --- SecondaryTier ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for count, key in enumerate(keys):
                entry = self._index.get(key)
                if entry is None or entry.state is not _State.READY:
                    return count
        return len(keys)

    @property
    def local(self) -> bool:
        return self._local

    def evicted_keys(self) -> Sequence[bytes]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def write_policy(self) -> str | None:
        """The engine's own slab extends the pinned pool: written as blocks leave it."""
        return "on_demote" if self._local else None

    @property
    def holds_keys(self) -> bool:
        return True

    def hold(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._holds[key] += 1
                entry = self._index.get(key)
                if entry is not None and entry.state is not _State.BAD and self._holds[key] == 1:
                    self._policy.update(key, entry.facts(held=True))

    def release(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            absent = [key for key, n in Counter(keys).items() if self._holds[key] < n]
            if absent:
                raise ValueError(f"release of {len(absent)} NVMe key(s) not held")
            for key in keys:
                self._holds[key] -= 1
                if self._holds[key] > 0:
                    continue
                del self._holds[key]
                entry = self._index.get(key)
                if entry is not None and entry.state is not _State.BAD:
                    self._policy.update(key, entry.facts(held=False))

    @property
    def num_held_keys(self) -> int:
        """Keys held now (stored or not yet)."""
        with self._lock:
            return len(self._holds)

    def counters(self) -> Mapping[str, int]:
        return asdict(self.stats())

    def stats(self) -> NvmeTierStats:
        return self._totals.snapshot()

    @property
    def num_keys(self) -> int:
        """Keys held (being written included)."""
        with self._lock:
            return len(self._index)

    def slot_of(self, key: bytes) -> int | None:
        """The slab slot holding `key`; None when it is not held."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.slot

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is either free or held by one key."""
        with self._lock:
            held = [entry.slot for entry in self._index.values()]
            assert len(set(held)) == len(held), "two keys share a slot"
            assert not set(held) & set(self._free), "a held slot is also free"
            assert len(held) + len(self._free) == self.disk.num_slots, "a slot went missing"
            self._policy.check_integrity(self._index.keys())
        self.disk.check_integrity()

    # --- stores -------------------------------------------------------------------------

    def _store(self, job: TransferJob) -> JobResult:
        start_s = self._clock()
        failed: set[bytes] = set()
        errors: Counter[str] = Counter()
        num_written = num_present = 0
        for key, host_slot in zip(job.keys, job.host_slots, strict=True):
            self._yield_to_loads()
            slot = self._claim(key)
            if slot is _NoSlot.PRESENT:
                num_present += 1
                continue
            if isinstance(slot, _NoSlot):
                failed.add(key)
                errors[slot.value] += 1
                continue
            try:
                self.disk.write_slot(slot, self.host_slots[host_slot].data)
            except DiskSlotError as exc:
                self._drop(key)
                failed.add(key)
                errors[exc.reason] += 1
                continue
            self._written(key)
            num_written += 1
        end_s = self._clock()
        self._totals.add(
            written_blocks=num_written, already_present=num_present,
            no_room_blocks=errors[_NoSlot.FULL.value],
            failed_writes=len(failed), cpu_to_nvme_bytes=num_written * self.block_bytes,
        )  # fmt: skip
        return job_result(
            job, failed, transfer_bytes=(num_written + num_present) * self.block_bytes,
            start_s=start_s, end_s=end_s, error=_describe(errors),
        )  # fmt: skip

    def _claim(self, key: bytes) -> int | _NoSlot:
        """A slot for `key`, now WRITING: a free one, or the policy's victim's."""
        with self._lock:
            present = self._index.get(key)
            if present is not None:
                return _NoSlot.DROPPING if present.state is _State.BAD else _NoSlot.PRESENT
            if self._free:
                slot = self._free.pop()
            else:
                victims = self._policy.evict(1)
                if victims is None:
                    return _NoSlot.FULL
                victim_key = victims[0]
                assert isinstance(victim_key, bytes), f"the policy evicted {victim_key!r}"
                victim = self._index.pop(victim_key)
                ready = victim.state is _State.READY and victim.num_readers == 0
                assert ready and victim_key not in self._holds, (
                    f"the NVMe tier's policy evicted a busy or held key ({victim})"
                )
                slot = victim.slot
                self._totals.add(evicted_blocks=1)
                if self._local:
                    self._evicted.append(victim_key)
            entry = self._index[key] = _Entry(slot)
            self._policy.insert(key, entry.facts(key in self._holds))
            return slot

    def _written(self, key: bytes) -> None:
        with self._lock:
            entry = self._index[key]
            entry.state = _State.READY
            self._policy.update(key, entry.facts(key in self._holds))

    # --- loads --------------------------------------------------------------------------

    def _load(self, job: TransferJob) -> JobResult:
        start_s = self._clock()
        failed: set[bytes] = set()
        errors: Counter[str] = Counter()
        for key, host_slot in zip(job.keys, job.host_slots, strict=True):
            slot = self._begin_read(key)
            if slot is None:
                failed.add(key)
                errors["missing"] += 1
                continue
            try:
                self.disk.read_slot(slot, self.host_slots[host_slot].data)
            except DiskSlotError as exc:
                self._end_read(key, good=False)
                failed.add(key)
                errors["checksum" if "checksum" in exc.reason else "read"] += 1
                continue
            self._end_read(key, good=True)
        end_s = self._clock()
        num_hits = job.num_blocks - len(failed)
        self._totals.add(
            hits_blocks=num_hits, misses_blocks=errors["missing"],
            corrupt_blocks=len(failed) - errors["missing"],
            nvme_to_cpu_bytes=num_hits * self.block_bytes,
        )  # fmt: skip
        return job_result(
            job, failed, transfer_bytes=num_hits * self.block_bytes, start_s=start_s,
            end_s=end_s, error=_describe(errors),
        )  # fmt: skip

    def _begin_read(self, key: bytes) -> int | None:
        """`key`'s slot, now read (busy: never a victim); None unless it is READY."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.state is not _State.READY:
                return None
            entry.num_readers += 1
            self._policy.update(key, entry.facts(key in self._holds))
            return entry.slot

    def _end_read(self, key: bytes, *, good: bool) -> None:
        with self._lock:
            entry = self._index[key]
            entry.num_readers -= 1
            if not good:
                entry.state = _State.BAD  # no lookup or load finds it from now on
            if entry.state is _State.BAD:
                if entry.num_readers == 0:
                    self._drop_locked(key)
                return
            self._policy.update(key, entry.facts(key in self._holds))
            self._policy.touch((key,))  # the most recently used, whatever the policy

    def _drop(self, key: bytes) -> None:
        with self._lock:
            self._drop_locked(key)

    def _drop_locked(self, key: bytes) -> None:
        entry = self._index.pop(key)
        self._policy.remove(key)
        self._free.append(entry.slot)

    def _release(self) -> None:
        self.disk.close()


def open_nvme_tier(
    host_slots: memoryview | HostSlots,
    directory: Path,
    num_slots: int,
    *,
    policy: EvictionPolicy,
    local: bool = False,
) -> NvmeTier:
    """A slab of `num_slots` slots in `directory`, each one host slot's bytes, as a tier
    over `host_slots` ranked by `policy` (built by the caller for `num_slots`); `local`:
    kvswap's engine's own (module docstring). The slab is removed again if the tier
    cannot be built."""
    disk = DiskPool(directory, as_host_slots(host_slots).shape[1], num_slots)
    try:
        return NvmeTier(host_slots, disk, policy=policy, local=local)
    except BaseException:
        disk.close()
        raise


def _describe(errors: Counter[str]) -> str | None:
    """'missing x2, checksum x1' (None when nothing failed)."""
    return ", ".join(f"{what} x{count}" for what, count in sorted(errors.items())) or None
