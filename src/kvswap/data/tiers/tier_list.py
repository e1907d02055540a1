"""An ordered list of secondary tiers as one: stores go to each, loads fall through.

The control plane has one key-addressed tier (`copy_adapter.TierCopyEngine`). To
stack several (the shared store, then a tier of one's own below it, then
another), the engine hands it a `TierList`, which is itself a `SecondaryTier`
over the same host slots, shaped as vLLM's tiering manager treats its secondary
tiers (it cascades every stored chunk to each, and promotes a miss from the first
that holds it):

    lookup(keys)        the longest prefix of `keys` whose every key some usable tier
                        holds: each tier is asked for what follows what the others
                        found, until a pass finds no more (a load then takes each
                        key from the first tier that has it)
    submit_store(job)   the same job to every usable tier; a key is stored when
                        one tier stored it (so a tier that lost it is not the last)
    submit_load(job)    the first usable tier; the keys it did not load (absent,
                        corrupt, the tier down) go to the next one, and so on
    get_finished_jobs   a job is finished when no tier still works on it
    hold / release      passed to each tier that holds keys (a key one of them
                        failed to store is held by the others only)
    counters()          each name summed over the tiers, and each tier's own as
                        `tier<i>_<name>` (tier 0 first)

A tier is added by appending it: no module of `kvswap.control` changes. Every
rule of `base.SecondaryTier` holds for the list as for one tier (results, never
exceptions, for a tier's failures; the host slots of a job untouched by the list
after its result is reported). Each tier sees the list's job ids: a store goes to a
tier once, a load visits each tier at most once. Threads: the control plane calls
from one; several threads may also each submit jobs and `wait` for their own (as
SGLang's HiCache does), a wait blocking outside the list's lock. Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvswap.data.tiers.base import JobResult, SecondaryTier, TransferJob, job_result


@dataclass
class _Job:
    """One job of the list, and which tiers still work on it."""

    job: TransferJob
    working: set[int] = field(default_factory=set)  # tier indexes with a part in flight
    tried: int = 0  # loads: the tiers asked so far (the next one is `tiers[tried]`)
    succeeded: set[bytes] = field(default_factory=set)
    transfer_bytes: int = 0
    start_s: float | None = None
    end_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class TierList(SecondaryTier):
    """`tiers`, fastest first, as one tier (module docstring, threads included). Owns
    them: `close()` closes each."""

    def __init__(self, tiers: Sequence[SecondaryTier]) -> None:
        if not tiers:
            raise ValueError("a tier list needs at least one tier")
        first = tiers[0]
        for index, tier in enumerate(tiers):
            if tier.host_slots.shape != first.host_slots.shape or (
                tier.host_slots.ctypes.data != first.host_slots.ctypes.data
            ):
                raise ValueError(
                    f"tier {index} ({type(tier).__name__}) is built over other host slots than "
                    f"tier 0: every tier of a list moves blocks to and from the same slots"
                )
        super().__init__(first.host_slots)
        self.tiers = tuple(tiers)
        self._jobs: dict[int, _Job] = {}
        self._done: dict[int, JobResult] = {}
        self._closed = False
        self._lock = threading.RLock()  # the bookkeeping; never held across a tier's wait

    # --- SecondaryTier ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        held = 0  # keys[:held] are each held by some usable tier
        # Per tier, the first key its last answer said it lacks: it is asked again only
        # once the others have found keys past it (no round trip for a known miss).
        lacks = [-1] * len(self.tiers)
        found = True
        while found and held < len(keys):  # a pass that finds nothing more ends it
            found = False
            for index, tier in enumerate(self.tiers):
                if held < len(keys) and held > lacks[index] and tier.available:
                    more = tier.lookup(keys[held:])
                    held += more
                    lacks[index] = held
                    found = found or more > 0
        return held

    @property
    def available(self) -> bool:
        return any(tier.available for tier in self.tiers)

    def submit_store(self, job: TransferJob) -> None:
        with self._lock:
            entry = self._take(job)
            for index, tier in enumerate(self.tiers):
                if tier.available:
                    tier.submit_store(job)
                    entry.working.add(index)
            self._settle(entry)

    def submit_load(self, job: TransferJob) -> None:
        with self._lock:
            entry = self._take(job)
            self._ask_next(entry, job.keys, job.host_slots)
            self._settle(entry)

    def get_finished_jobs(self) -> list[JobResult]:
        with self._lock:
            for index, tier in enumerate(self.tiers):
                for result in tier.get_finished_jobs():
                    self._landed(index, result)
            done = sorted(self._done.values(), key=lambda result: result.end_s)
            self._done = {}
        return done

    def wait(self, job_id: int) -> JobResult:
        while True:
            with self._lock:
                entry = self._jobs.get(job_id)
                if entry is None:
                    if job_id not in self._done:
                        raise ValueError(
                            f"job {job_id} is not pending: never submitted or already reported"
                        )
                    return self._done.pop(job_id)
                index = min(entry.working)
            result = self.tiers[index].wait(job_id)  # outside the lock: others go on
            with self._lock:
                self._landed(index, result)

    def drain(self) -> None:
        with self._lock:
            while self._jobs:  # a load's next part may start while the last part lands
                for tier in self.tiers:
                    tier.drain()
                for index, tier in enumerate(self.tiers):
                    for result in tier.get_finished_jobs():
                        self._landed(index, result)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tier in self.tiers:
            tier.close()

    @property
    def holds_keys(self) -> bool:
        return any(tier.holds_keys for tier in self.tiers)

    def hold(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            if tier.holds_keys:
                tier.hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            if tier.holds_keys:
                tier.release(keys)

    def counters(self) -> Mapping[str, int]:
        return merged_counters(self.tiers)

    # --- bookkeeping ------------------------------------------------------------------

    def _take(self, job: TransferJob) -> _Job:
        if self._closed:
            raise ValueError(f"job {job.job_id}: the tier list is closed")
        if job.job_id in self._jobs or job.job_id in self._done:
            raise ValueError(f"job {job.job_id}: id already in use by a pending job")
        self.check_job(job)
        entry = _Job(job)
        self._jobs[job.job_id] = entry
        return entry

    def _ask_next(self, entry: _Job, keys: Sequence[bytes], host_slots: Sequence[int]) -> None:
        """Loads: ask the next usable tier for `keys` (into `host_slots`), if one is left."""
        while entry.tried < len(self.tiers):
            index = entry.tried
            entry.tried += 1
            tier = self.tiers[index]
            if tier.available:
                tier.submit_load(TransferJob(entry.job.job_id, tuple(keys), tuple(host_slots),
                                             is_load=True))  # fmt: skip
                entry.working.add(index)
                return

    def _landed(self, index: int, result: JobResult) -> None:
        """Tier `index` finished its part of a job."""
        entry = self._jobs[result.job_id]
        entry.working.discard(index)
        entry.succeeded.update(result.successful_keys)
        entry.transfer_bytes += result.transfer_bytes
        entry.start_s = result.start_s if entry.start_s is None else min(entry.start_s,
                                                                        result.start_s)  # fmt: skip
        entry.end_s = max(entry.end_s, result.end_s)
        if result.error:
            entry.errors.append(f"tier {index} ({type(self.tiers[index]).__name__}): "
                                f"{result.error}")  # fmt: skip
        job = entry.job
        if job.is_load:
            missing = [(key, slot) for key, slot in zip(job.keys, job.host_slots, strict=True)
                       if key not in entry.succeeded]  # fmt: skip
            if missing:
                keys, slots = zip(*missing, strict=True)
                self._ask_next(entry, keys, slots)
        self._settle(entry)

    def _settle(self, entry: _Job) -> None:
        """Report `entry` once no tier works on it (at once when no tier was usable)."""
        if entry.working:
            return
        job = entry.job
        del self._jobs[job.job_id]
        failed = frozenset(job.keys) - entry.succeeded
        verb = "loaded" if job.is_load else "stored"
        reasons = "; ".join(entry.errors)
        error = reasons or f"{len(failed)} of {job.num_blocks} keys {verb} by no tier"
        if entry.start_s is None:  # no tier took a part: finished now
            entry.start_s = entry.end_s = time.perf_counter()
        self._done[job.job_id] = job_result(
            job, failed, transfer_bytes=entry.transfer_bytes, start_s=entry.start_s,
            end_s=entry.end_s, error=error if failed else None,
        )  # fmt: skip


def merged_counters(tiers: Sequence[SecondaryTier]) -> dict[str, int]:
    """The counters of `tiers` as one record: one tier's as they are; several tiers'
    each name summed over them, and each tier's own as `tier<i>_<name>` (tier 0 first)."""
    if len(tiers) == 1:
        return dict(tiers[0].counters())
    total: dict[str, int] = {}
    for index, tier in enumerate(tiers):
        for name, count in tier.counters().items():
            total[name] = total.get(name, 0) + count
            total[f"tier{index}_{name}"] = count
    return total
