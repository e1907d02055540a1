"""Secondary tiers whose copies block (sockets, files): jobs run on threads.

`LaneTier` implements a `SecondaryTier`'s job bookkeeping once; a tier adds
what a load and a store do (`_load`, `_store`) and its `lookup`:

    submit_load(job)    -> a load lane  (FIFO, `num_load_lanes` threads)  -> _load(job)
    submit_store(job)   -> _refuse_store(job): a reason -> failed at once, "write skipped: ..."
                           otherwise a store lane (`num_store_lanes` threads) -> _store(job)
    get_finished_jobs(), wait(id), drain()    the futures the lanes complete
                                              (`FutureResults`, with its liveness check)

Loads go first: they are what a request waits for. Load and store lanes are
separate threads, and a store calls `_yield_to_loads()` before each batch of
copies, which waits while any load is pending or running (`LinkArbiter`).
Lanes sleep on their queues while idle. A lane never raises: a bug in `_load`
or `_store` becomes a failed result naming it, never a hung waiter.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, TypeVar

from kvswap.data.block_copy import error_text
from kvswap.data.future_results import FutureResults
from kvswap.data.link_arbiter import LinkArbiter
from kvswap.data.tiers.base import (
    HostSlots,
    JobResult,
    SecondaryTier,
    TransferJob,
    failed_job,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Job = tuple[TransferJob, Future[JobResult]]


class _Lanes:
    """`count` threads serving one FIFO; `run` never raises into a thread, and
    `settle` runs before the result is published."""

    def __init__(
        self,
        name: str,
        count: int,
        run: Callable[[TransferJob], JobResult],
        settle: Callable[[TransferJob], None],
        clock: Callable[[], float],
    ) -> None:
        self._run = run
        self._settle = settle
        self._clock = clock
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvswap-{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def put(self, job: TransferJob, future: Future[JobResult]) -> None:
        self._jobs.put((job, future))

    def stop(self) -> None:
        for _thread in self._threads:
            self._jobs.put(None)  # after every queued job: they finish first

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def is_alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            start_s = self._clock()
            try:
                result = self._run(job)
            except BaseException as exc:  # a bug: still a result, never a hung waiter
                result = failed_job(job, start_s, self._clock(), error_text(exc))
            self._settle(job)
            future.set_result(result)


class LaneTier(SecondaryTier, FutureResults[TransferJob, JobResult]):
    """A `SecondaryTier` over load and store lanes (module docstring). Times are on
    `clock` (perf_counter by default). A subclass checks its options before calling
    this constructor, which starts the threads."""

    def __init__(
        self,
        host_slots: memoryview | HostSlots,
        *,
        name: str,
        num_load_lanes: int = 1,
        num_store_lanes: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for option, value in (("num_load_lanes", num_load_lanes),
                              ("num_store_lanes", num_store_lanes)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        SecondaryTier.__init__(self, host_slots)
        FutureResults.__init__(self)
        self._clock = clock
        self._arbiter = LinkArbiter()
        self._drained: list[JobResult] = []  # finished by drain(), not yet reported
        self._closed = False
        self._loads = _Lanes(f"{name}-load", num_load_lanes, self._load, self._load_done, clock)
        self._stores = _Lanes(
            f"{name}-store", num_store_lanes, self._store, self._store_done, clock
        )

    # --- SecondaryTier ----------------------------------------------------------------

    def submit_load(self, job: TransferJob) -> None:
        self._check(job, is_load=True)
        future = self._track(job)
        self._arbiter.high_submitted()  # before a store lane's next batch check
        self._loads.put(job, future)

    def submit_store(self, job: TransferJob) -> None:
        self._check(job, is_load=False)
        future = self._track(job)
        reason = self._refuse_store(job)
        if reason is not None:
            now_s = self._clock()
            future.set_result(failed_job(job, now_s, now_s, f"write skipped: {reason}"))
            return
        self._stores.put(job, future)

    def get_finished_jobs(self) -> list[JobResult]:
        results = self._drained + self._done_results()
        self._drained = []
        return sorted(results, key=lambda result: result.end_s)

    def wait(self, job_id: int) -> JobResult:
        for index, result in enumerate(self._drained):
            if result.job_id == job_id:
                return self._drained.pop(index)
        return self._wait_result(job_id)

    def drain(self) -> None:
        self._drained.extend(self._wait_all_results())

    def close(self) -> None:
        """Let queued jobs finish, join the lanes, then `_release()`."""
        if self._closed:
            return
        self._closed = True
        for lanes in (self._loads, self._stores):
            lanes.stop()
        for lanes in (self._loads, self._stores):
            lanes.join()
        self._release()

    # --- what a tier adds -------------------------------------------------------------

    @abstractmethod
    def _load(self, job: TransferJob) -> JobResult:
        """Copy the tier's `job.keys` into `job.host_slots` (on a load lane)."""

    @abstractmethod
    def _store(self, job: TransferJob) -> JobResult:
        """Copy `job.host_slots` into the tier (on a store lane); call
        `_yield_to_loads()` before each batch of copies."""

    def _refuse_store(self, job: TransferJob) -> str | None:
        """Why `job` is skipped instead of queued (on the caller's thread); None: queue
        it. Default: never skipped."""
        return None

    def _store_done(self, job: TransferJob) -> None:
        """A store lane finished `job` (before its result is published). Default: nothing."""

    def _release(self) -> None:
        """After the lanes are joined: release connections, files. Default: nothing."""

    def _yield_to_loads(self) -> None:
        self._arbiter.wait_until_no_high()

    # --- the bookkeeping --------------------------------------------------------------

    def _load_done(self, _job: TransferJob) -> None:
        self._arbiter.high_finished()

    def _check(self, job: TransferJob, *, is_load: bool) -> None:
        if self._closed:
            raise ValueError(f"job {job.job_id}: the tier is closed")
        if self._is_pending(job.job_id) or any(r.job_id == job.job_id for r in self._drained):
            raise ValueError(f"job {job.job_id}: id already in use by a pending job")
        if job.is_load != is_load:
            raise ValueError(f"job {job.job_id}: is_load={job.is_load} submitted as the other")
        self.check_job(job)

    def _id_of(self, job: TransferJob) -> int:
        return job.job_id

    def _lane_alive(self, job: TransferJob) -> bool:
        return (self._loads if job.is_load else self._stores).is_alive()

    def _dead_lane_result(self, job: TransferJob) -> JobResult:
        now_s = self._clock()
        return failed_job(job, now_s, now_s, "tier lane exited")


StatsT = TypeVar("StatsT", bound="DataclassInstance")


class Totals(Generic[StatsT]):
    """A frozen counts record (a dataclass of numbers) that lanes add to under a lock."""

    def __init__(self, zero: StatsT) -> None:
        self._lock = threading.Lock()
        self._totals = zero

    def add(self, **counts: float) -> None:
        with self._lock:
            totals = self._totals
            summed = {name: getattr(totals, name) + count for name, count in counts.items()}
            self._totals = dataclasses.replace(totals, **summed)

    def snapshot(self) -> StatsT:
        with self._lock:
            return self._totals
