"""A secondary tier: KV blocks by key below the pinned host pool, moved in jobs.

The interface kvswap's tiers implement (the Redis store, `redis_tier.py`; the
NVMe slab by key, `nvme_tier.py`) and a user's own tier can, shaped like vLLM's
`SecondaryTierManager` (vllm/v1/kv_offload/tiering) so that one adapter can
later hand kvswap's tiers to vLLM: `lookup`, `submit_store(job)`,
`submit_load(job)`, `get_finished_jobs()`, results with `success` and the keys
that did succeed. A secondary tier never touches GPU memory: every byte moves
between it and the host pool (vLLM's primary tier), which it sees as one byte
view, and is named by its 32-byte block key (`kvswap.base.identity`):

    host_slots: [num_host_slots, block_bytes] uint8  (numpy array or 2-D memoryview)
    store   host_slots[job.host_slots[i]]  ->  the tier, as job.keys[i]
    load    the tier's job.keys[i]         ->  host_slots[job.host_slots[i]]

Who calls what, in which order. One caller (the control thread; in vLLM the
scheduler); every call but `wait` and `drain` returns at once:

    lookup(keys)          how many of `keys`, from the first, the tier holds now
                          (a prefix); at most one bounded round trip
    submit_store(job)     host -> tier. The caller leaves the job's host slots as they
                          are until its result is reported (the tier reads them late)
    submit_load(job)      tier -> host. The caller gave the job's host slots to it:
                          nobody reads or writes them until its result is reported
    get_finished_jobs()   the results of jobs finished since the last call; each job
                          is reported once, here or by `wait`
    wait(job_id)          block until that job finished; its result (not reported again)
    drain()               block until every submitted job finished; their results
                          come with the next `get_finished_jobs()`
    write_policy          when the engine writes to it (None: the configured policy)
    hold(keys)            keep `keys` from being evicted until as many `release(keys)`:
    release(keys)         the only copy of a paused sequence's blocks (`holds_keys`:
                          whether the tier can; a store shared with other processes,
                          evicting by its own rules, cannot, and says False)
    local                 the tier is this process's own (the NVMe slab by key): the
    evicted_keys()        engine remembers the blocks it holds, and it says which keys
                          it evicted since the last call, so those copies are dropped
    close()               once, at the end: queued jobs finish, threads, connections
                          and files are released

`wait` is kvswap's, not vLLM's: when a decode step cannot go on without a block
(a swap-in stall, `CopyEngine.wait`), the swapper needs that one job now.
Polling `get_finished_jobs` in a loop would spin on a core the model is using
and add a poll interval to the stall; the tier knows when the job is done.

Failures are results, never exceptions. A key the tier does not hold, a value
that fails a check (corrupt, or found under another key), or a tier that is
down or full, is a key left out of `successful_keys`: the caller recomputes
that block and never trusts its host slot. `lookup` answers 0 for a tier that
is down. A wrong argument (a job id in use, a host slot out of range, a job
after `close`) is a programming error: ValueError.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import numpy.typing as npt

from kvswap.base.identity import KEY_BYTES

#: The host pool as a tier sees it: [num_host_slots, block_bytes] uint8, rows contiguous.
HostSlots = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class TransferJob:
    """Blocks to move between the host pool and a tier: `keys[i]` <-> `host_slots[i]`.
    `is_load`: tier -> host (vLLM's `is_promotion`); else host -> tier."""

    job_id: int
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]
    is_load: bool

    def __post_init__(self) -> None:
        n = len(self.keys)
        if n < 1 or len(self.host_slots) != n:
            raise ValueError(
                f"job {self.job_id}: needs >= 1 key and one host slot per key, got {n} keys "
                f"and {len(self.host_slots)} slots"
            )
        if any(len(key) != KEY_BYTES for key in self.keys):
            raise ValueError(f"job {self.job_id}: every key must be {KEY_BYTES} bytes")
        if len(set(self.host_slots)) != n or min(self.host_slots) < 0:
            raise ValueError(f"job {self.job_id}: host slots {self.host_slots} repeat or are < 0")

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class JobResult:
    """What became of one job. `success`: every key succeeded (vLLM's meaning);
    `successful_keys`: those that did (loaded intact; stored, or already held),
    all of them when `success`. `transfer_bytes`: bytes moved for them. Times are
    seconds on the tier's clock; `error` says in one line why keys failed."""

    job_id: int
    success: bool
    successful_keys: tuple[bytes, ...]
    transfer_bytes: int
    start_s: float
    end_s: float
    error: str | None = None

    @property
    def transfer_time_s(self) -> float:
        return self.end_s - self.start_s


def job_result(
    job: TransferJob,
    failed_keys: Collection[bytes],
    *,
    transfer_bytes: int,
    start_s: float,
    end_s: float,
    error: str | None = None,
) -> JobResult:
    """The result of `job` in which exactly `failed_keys` failed."""
    ok = tuple(key for key in job.keys if key not in failed_keys)
    return JobResult(
        job.job_id, len(ok) == job.num_blocks, ok, transfer_bytes, start_s, max(start_s, end_s),
        error,
    )  # fmt: skip


def failed_job(job: TransferJob, start_s: float, end_s: float, error: str) -> JobResult:
    """The result of `job` in which every key failed."""
    return job_result(job, frozenset(job.keys), transfer_bytes=0, start_s=start_s,
                      end_s=end_s, error=error)  # fmt: skip


def as_host_slots(view: memoryview | HostSlots) -> HostSlots:
    """`view` as a writable [num_host_slots, block_bytes] uint8 array sharing its memory;
    ValueError in one line for anything else."""
    array = np.asarray(view)
    if array.dtype != np.uint8 or array.ndim != 2 or 0 in array.shape:
        raise ValueError(
            f"host slots must be a non-empty 2-D uint8 view [num_slots, block_bytes], got "
            f"{array.dtype} of shape {array.shape}"
        )
    if array.strides[1] != 1 or not array.flags.writeable:
        raise ValueError("host slots must be writable, each slot's bytes contiguous")
    return array


class SecondaryTier(ABC):
    """Blocks by key, moved to and from one host pool in jobs (module docstring)."""

    def __init__(self, host_slots: memoryview | HostSlots) -> None:
        self.host_slots = as_host_slots(host_slots)
        self.num_host_slots, self.block_bytes = (int(n) for n in self.host_slots.shape)

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the tier holds (the first absent key
        ends the prefix; an answer may stop short, never run long). Never raises for
        a tier problem: a tier that is down answers 0."""

    @property
    def available(self) -> bool:
        """False while the tier is known to be unusable (the caller skips lookups and
        stores). Default: always usable."""
        return True

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Start copying `job.host_slots` into the tier as `job.keys`; returns at once.
        A key already held succeeds without a copy (a block never changes)."""

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Start copying the tier's `job.keys` into `job.host_slots`; returns at once."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, by end time; never blocks."""

    @abstractmethod
    def wait(self, job_id: int) -> JobResult:
        """Block until job `job_id` finished; its result, not reported again. ValueError
        for a job never submitted or already reported."""

    @abstractmethod
    def drain(self) -> None:
        """Block until every submitted job finished (no copy touches the host pool after
        this); their results come with the next `get_finished_jobs()`."""

    @abstractmethod
    def close(self) -> None:
        """Let queued jobs finish, then release what the tier holds; safe to call twice."""

    @property
    def holds_keys(self) -> bool:
        """Whether `hold` keeps a key in the tier: a tier that evicts by a policy of its
        own and can pass over some keys says True. Default: False (`hold` and `release`
        do nothing, and the caller knows a held key may still leave)."""
        return False

    def hold(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - most stores cannot hold
        """Keep each of `keys` from being evicted until one `release` for each `hold`
        (holds are counted per key). A key not held yet is kept once it is stored; a
        load that fails (a corrupt value) still drops it. Default: nothing."""

    def release(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - as `hold`
        """End one `hold` of each of `keys`: it may be evicted again once no hold is
        left. ValueError for a key not held. Default: nothing."""

    @property
    def local(self) -> bool:
        """Whether the tier is this process's own, evicting by its own policy and saying
        what it evicted (`evicted_keys`): the engine then remembers the blocks it holds,
        as it does a slot tier's (the NVMe slab by key). At most one, first among the
        engine's tiers. Default: False (a store that others share: a block known only
        there is forgotten, and found again by a lookup)."""
        return False

    def evicted_keys(self) -> Sequence[bytes]:
        """A local tier's keys evicted since the last call, oldest first. Default: none."""
        return ()

    @property
    def capacity_blocks(self) -> int | None:
        """The blocks the tier holds at most, where it knows (the NVMe slab: its slots);
        kvswap's engine reports a local tier's occupancy against it. Default: None."""
        return None

    @property
    def write_policy(self) -> str | None:
        """When kvswap's engine writes blocks to this tier: "on_finish" (a finished
        sequence's full blocks, early: what other processes may ask for), "on_demote"
        (a block leaving the pinned pool: a tier that extends the pool) or "off" (read
        only). Default None: as `tiers.remote_write_policy` says. (Inside vLLM its
        tiering manager decides.)"""
        return None

    def counters(self) -> Mapping[str, int]:
        """The tier's counts by name (hits, corrupt values, skipped stores, ...), for a
        run summary's `remote` object and the metrics exporter. Default: none."""
        return {}

    def check_job(self, job: TransferJob) -> None:
        """ValueError unless every host slot of `job` is one of this tier's host slots."""
        if max(job.host_slots) >= self.num_host_slots:
            raise ValueError(
                f"job {job.job_id}: host slots {job.host_slots} leave [0, {self.num_host_slots})"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
