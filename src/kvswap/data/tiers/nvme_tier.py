"""The NVMe slab as a keyed secondary tier: `DiskPool` slots by block key, evicting by policy.

Which key has which slot, which keys are held and which one leaves for a new
one is the slab's index, `kvswap.base.key_slots.KeySlots` (the simulator models
the slab with the same index): key -> (slot, WRITING / READY / BAD, readers),
the free slots, the holds and the eviction policy the caller built for the
NVMe tier (the adapters: `kvswap.control.policy.named_policy`). One lock guards
it, and the copies run outside it.

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

The policy sees each key as `KeySlots` describes (under "kvswap" and "lru"
alike the least recently stored or loaded key leaves first). The tier owns the
`DiskPool`: `close()` closes it (the slab file is removed unless persisted).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvswap.base.eviction_policy import EvictionPolicy
from kvswap.base.key_slots import KeySlots, NoSlot
from kvswap.data.disk_pool import DiskPool, DiskSlotError
from kvswap.data.tiers.base import HostSlots, JobResult, TransferJob, as_host_slots, job_result
from kvswap.data.tiers.lanes import LaneTier, Totals


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
        self._lock = threading.Lock()  # guards the index
        self._slots = KeySlots(disk.num_slots, policy, keep_evicted=local)
        self._local = local
        self._totals = Totals(NvmeTierStats())
        super().__init__(
            slots, name="nvme", num_load_lanes=num_read_lanes, num_store_lanes=num_write_lanes,
            clock=clock,
        )  # fmt: skip

    # --- SecondaryTier ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return self._slots.lookup(keys)

    @property
    def local(self) -> bool:
        return self._local

    def evicted_keys(self) -> Sequence[bytes]:
        with self._lock:
            return self._slots.take_evicted()

    @property
    def capacity_blocks(self) -> int:
        return self.disk.num_slots

    @property
    def write_policy(self) -> str | None:
        """The engine's own slab extends the pinned pool: written as blocks leave it."""
        return "on_demote" if self._local else None

    @property
    def holds_keys(self) -> bool:
        return True

    def hold(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._slots.hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._slots.release(keys)

    @property
    def num_held_keys(self) -> int:
        """Keys held now (stored or not yet)."""
        with self._lock:
            return self._slots.num_held_keys

    def counters(self) -> Mapping[str, int]:
        return asdict(self.stats())

    def stats(self) -> NvmeTierStats:
        return self._totals.snapshot()

    @property
    def num_keys(self) -> int:
        """Keys held (being written included)."""
        with self._lock:
            return len(self._slots)

    def slot_of(self, key: bytes) -> int | None:
        """The slab slot holding `key`; None when it is not held."""
        with self._lock:
            return self._slots.slot_of(key)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is either free or held by one key."""
        with self._lock:
            self._slots.check_integrity()
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
            if slot is NoSlot.PRESENT:
                num_present += 1
                continue
            if isinstance(slot, NoSlot):
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
            with self._lock:
                self._slots.written(key)
            num_written += 1
        end_s = self._clock()
        self._totals.add(
            written_blocks=num_written, already_present=num_present,
            no_room_blocks=errors[NoSlot.FULL.value],
            failed_writes=len(failed), cpu_to_nvme_bytes=num_written * self.block_bytes,
        )  # fmt: skip
        return job_result(
            job, failed, transfer_bytes=(num_written + num_present) * self.block_bytes,
            start_s=start_s, end_s=end_s, error=_describe(errors),
        )  # fmt: skip

    def _claim(self, key: bytes) -> int | NoSlot:
        """A slot for `key`, now WRITING: a free one, or the policy's victim's."""
        with self._lock:
            evicted_before = self._slots.num_evicted
            slot = self._slots.claim(key)
            self._totals.add(evicted_blocks=self._slots.num_evicted - evicted_before)
            return slot

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
            return self._slots.begin_read(key)

    def _end_read(self, key: bytes, *, good: bool) -> None:
        with self._lock:
            self._slots.end_read(key, good=good)

    def _drop(self, key: bytes) -> None:
        with self._lock:
            self._slots.drop(key)

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
