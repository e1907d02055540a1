"""The result side every threaded copy engine and tier shares: one future per submitted job.

    submit(job)  -> _track(job)  -> a Future the engine's lane completes
    poll()       -> the done futures' results, by end time (never blocks)
    wait(id)     -> that job's result (not reported again)
    wait_all()   -> every unreported result

A job is a copy engine's `TransferChunk` (`kvswap.data.copy_engine.LocalCopyEngine`)
or a secondary tier's `TransferJob` (`kvswap.data.tiers.lanes.LaneTier`);
`FutureResults` is the part they share, generic in the job and its result.

A waiter wakes every `LIVENESS_CHECK_S` to check the lane it waits on is still
alive: lanes that die fail their jobs themselves, so this is only the last
resort should every lane be gone without doing so.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Generic, Protocol, TypeVar

#: How often a waiter checks that the lane it waits on is still alive.
LIVENESS_CHECK_S = 0.5


class _Finished(Protocol):
    @property
    def end_s(self) -> float: ...


JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT", bound=_Finished)


class FutureResults(ABC, Generic[JobT, ResultT]):
    """Submitted jobs not yet reported, each with the future its lane completes.
    Called from one control thread; lanes only complete futures."""

    #: How an id is named in errors ("transfer 7 is not pending ...").
    _id_word = "job"

    def __init__(self) -> None:
        # Submitted and not yet reported, in submit order.
        self._pending: dict[int, tuple[JobT, Future[ResultT]]] = {}

    @property
    def num_pending(self) -> int:
        """Jobs submitted whose results have not been reported yet."""
        return len(self._pending)

    def _track(self, job: JobT) -> Future[ResultT]:
        """The future `job`'s lane completes (the id is checked unused by the caller)."""
        future: Future[ResultT] = Future()
        self._pending[self._id_of(job)] = (job, future)
        return future

    def _is_pending(self, job_id: int) -> bool:
        return job_id in self._pending

    def _done_results(self) -> list[ResultT]:
        """Results finished since the last call, in order of end time; never blocks."""
        done = [job_id for job_id, (_job, future) in self._pending.items() if future.done()]
        results = [self._pending.pop(job_id)[1].result() for job_id in done]
        return sorted(results, key=lambda result: result.end_s)

    def _wait_result(self, job_id: int) -> ResultT:
        """Block until job `job_id` finishes; its result is not reported again."""
        entry = self._pending.pop(job_id, None)
        if entry is None:
            raise ValueError(
                f"{self._id_word} {job_id} is not pending: never submitted or already reported"
            )
        return self._await(*entry)

    def _wait_all_results(self) -> list[ResultT]:
        """Block until every submitted job finishes; the unreported results."""
        entries = list(self._pending.values())
        self._pending.clear()
        results = [self._await(job, future) for job, future in entries]
        return sorted(results, key=lambda result: result.end_s)

    def _await(self, job: JobT, future: Future[ResultT]) -> ResultT:
        while True:
            try:
                return future.result(timeout=LIVENESS_CHECK_S)
            except FutureTimeoutError:
                if not self._lane_alive(job) and not future.done():
                    return self._dead_lane_result(job)

    # -- what each user says about its jobs and lanes -----------------------------------

    @abstractmethod
    def _id_of(self, job: JobT) -> int:
        """The job's id (unique among pending jobs)."""

    @abstractmethod
    def _lane_alive(self, job: JobT) -> bool:
        """Is some lane that can run `job` still alive?"""

    @abstractmethod
    def _dead_lane_result(self, job: JobT) -> ResultT:
        """A failed result for `job`, whose lanes all exited without reporting it."""
