"""`DictTier`: a secondary tier of one's own in a dict of bytes, for tests.

It is all a user writes to add a tier (`kvswap.data.tiers.base.SecondaryTier`):
lookups, stores and loads by key over the host slots it is given. Jobs run at
submit, or, with `deferred`, when their results are asked for (`get_finished_jobs`,
`wait`, `drain`), as a tier whose copies run elsewhere. `down`: the tier reports
itself unusable. Keys in `corrupt` fail every load, as a value failing its check.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from kvswap.data.tiers.base import HostSlots, JobResult, SecondaryTier, TransferJob, job_result


class DictTier(SecondaryTier):
    """Blocks in a dict (shared by every engine given it), copied at submit."""

    def __init__(
        self, host_slots: HostSlots, values: dict[bytes, bytes], *, deferred: bool = False
    ) -> None:
        super().__init__(host_slots)
        self.values = values
        self.deferred = deferred
        self.down = False
        self.corrupt: set[bytes] = set()
        self.num_loaded_blocks = 0
        self.jobs_seen: list[TransferJob] = []
        self._queued: list[TransferJob] = []
        self._finished: dict[int, JobResult] = {}
        self.closed = False

    @property
    def available(self) -> bool:
        return not self.down

    def lookup(self, keys: Sequence[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.values), len(keys))

    def submit_store(self, job: TransferJob) -> None:
        self._submit(job)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job)

    def _submit(self, job: TransferJob) -> None:
        self.check_job(job)
        self.jobs_seen.append(job)
        self._queued.append(job)
        if not self.deferred:
            self._run_queued()

    def _run_queued(self) -> None:
        for job in self._queued:
            if job.is_load:
                failed = {key for key in job.keys if key not in self.values or key in self.corrupt}
                for key, slot in zip(job.keys, job.host_slots, strict=True):
                    if key not in failed:
                        self.host_slots[slot] = np.frombuffer(self.values[key], np.uint8)
                        self.num_loaded_blocks += 1
            else:
                failed = set()
                for key, slot in zip(job.keys, job.host_slots, strict=True):
                    self.values.setdefault(key, self.host_slots[slot].tobytes())
            self._finish(job, failed)
        self._queued.clear()

    def _finish(self, job: TransferJob, failed: Collection[bytes]) -> None:
        moved_bytes = (job.num_blocks - len(failed)) * self.block_bytes
        now_s = time.perf_counter()
        self._finished[job.job_id] = job_result(
            job, failed, transfer_bytes=moved_bytes, start_s=now_s, end_s=now_s
        )

    def get_finished_jobs(self) -> list[JobResult]:
        self._run_queued()
        done, self._finished = list(self._finished.values()), {}
        return done

    def wait(self, job_id: int) -> JobResult:
        self._run_queued()
        return self._finished.pop(job_id)

    def drain(self) -> None:
        self._run_queued()

    def close(self) -> None:
        self.closed = True

    def counters(self) -> Mapping[str, int]:
        return {"loaded_blocks": self.num_loaded_blocks}


#: The blocks of `shared_tier`, shared by every engine that builds one.
SHARED_VALUES: dict[bytes, bytes] = {}


def shared_tier(host_slots: HostSlots, _layout: object) -> DictTier:
    """A factory to name by import path (`tiers.secondary_tiers`): a `DictTier` over
    `SHARED_VALUES`."""
    return DictTier(host_slots, SHARED_VALUES)


def not_a_tier(host_slots: HostSlots, _layout: object) -> dict[str, int]:
    return {"slots": len(host_slots)}


class RaisingTier(DictTier):
    """A tier that breaks the interface: its loads raise instead of failing keys."""

    def submit_load(self, job: TransferJob) -> None:
        raise OSError("the archive went away\nsecond line")


def failing_tier(host_slots: HostSlots, _layout: object) -> DictTier:
    raise OSError("no room on /mnt/tier\nsecond line")
