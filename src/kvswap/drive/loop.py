"""THE driver loop: arrivals -> schedule -> execute -> complete -> observe -> progress.

One loop for the engine, the simulator and the server (they differ only in the
Backend and in where requests come from):

    while requests remain (or may still come):
        admit arrivals that are due
        nothing to run?        idle until the next arrival
        plan = schedule()      swap-ins started and waited for
        empty plan?            wait for a transfer, idle until an arrival, or retry
        output = backend.execute(plan)
        complete(plan, output) outputs appended (a failed sampling aborts its sequence);
                               offload; swap-out past the watermark
        observers, listener, progress
    drain transfers; summary

`Driver.step()` is one pass of that loop, so a caller can interleave several
drivers (the simulator's engines sharing one remote store) or serve requests
that arrive while it runs (`kvswap serve`); `drive()` runs one to the end.

The retry rule: an empty plan with nothing moving and no arrival to wait for
is retried while a retry can help (each `schedule` may have dropped a paused
sequence's KV in its recompute fallback after its last attempt), then the
run stops with a one-line error.

The failure rule: whatever fails while admitting or serving one request ends
that request alone, and the loop goes on. Admission refuses it
(`Scheduler.add_request`); a failure the scheduler can name
(`control.request_fault.RequestFailed`) aborts that request; a step the backend
cannot compute is run again one request at a time, and only the requests that
fail alone are aborted (the exact mode's outputs are the same in any batch).
After an abort the control plane checks its invariants; a failure it cannot
contain (a broken invariant, the machinery every request shares) stops the run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from kvswap.control.request_fault import failure_reason
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import StepPlan
from kvswap.drive.assembly import ControlPlane
from kvswap.drive.backend import Backend, StepOutput
from kvswap.drive.summary import RunSummary, StepTotals, build_summary
from kvswap.errors import KvSwapError
from kvswap.obs.observer import StepObserver, sample_step
from kvswap.progress import RequestProgress
from kvswap.sampling import SamplingParams, TokenLogprobs
from kvswap.workload.arrivals import ArrivalQueue
from kvswap.workload.request import Workload


class Arrivals(Protocol):
    """Where requests come from: a workload replayed on the clock (`ArrivalQueue`),
    or a server's live inbox. Truthy while requests may still arrive."""

    def __bool__(self) -> bool: ...

    def next_arrival_s(self) -> float | None:
        """When the next known request arrives; None: none known yet."""

    def admit_due(self, scheduler: Scheduler, now_s: float) -> None:
        """Hand every request arrived by `now_s` to the scheduler."""

    def finished(self, request_id: int, output_ids: Sequence[int], done_s: float) -> None:
        """A request finished with these output tokens."""

    def idle(self, backend: Backend, now_s: float) -> None:
        """Nothing runs: wait (a bounded time) for the next arrival."""


#: Told after every step: the plan, what the backend produced (sampled tokens, their
#: logprobs), the requests that finished.
StepListener = Callable[[StepPlan, StepOutput, Sequence[int]], None]


class Driver:
    """The loop, one pass per `step()`; `summary()` once `step()` returned False."""

    def __init__(
        self,
        control: ControlPlane,
        backend: Backend,
        arrivals: Arrivals,
        *,
        num_requests: Callable[[], int],
        progress: RequestProgress | None = None,
        observers: Sequence[StepObserver] = (),
        listener: StepListener | None = None,
    ) -> None:
        self.control = control
        self.backend = backend
        self.arrivals = arrivals
        self._num_requests = num_requests
        self._progress = progress
        self._observers = observers
        self._listener = listener
        self.step_s = self.swap_wait_s = 0.0
        self.num_steps = 0
        self._num_stalled = 0
        backend.start()

    @property
    def scheduler(self) -> Scheduler:
        return self.control.scheduler

    def step(self) -> bool:
        """One pass of the loop; False when every request is served and none may come."""
        scheduler, swapper = self.control.scheduler, self.control.swapper
        if not (self.arrivals or scheduler.has_work()):
            return False
        backend = self.backend
        now_s = backend.now_s()
        self.arrivals.admit_due(scheduler, now_s)
        next_s = self.arrivals.next_arrival_s()
        if not scheduler.has_work():
            swapper.tend()
            self.arrivals.idle(backend, now_s)
            self._report_progress()  # rejected requests finish without a step
            return True
        step_start_s = backend.now_s()
        plan = scheduler.schedule(now_s)
        if plan.aborted:
            self._end_aborted(plan.aborted, now_s)
        if not plan.seqs:
            if swapper.wait_any():
                return True  # a transfer finished: room may have appeared
            if next_s is not None and next_s > now_s:
                backend.idle_until(next_s)
                return True
            self._num_stalled += 1
            if self._num_stalled <= len(scheduler.preempted) + len(scheduler.running) + 1:
                return True
            raise KvSwapError(
                "the run cannot make progress: the GPU tier is held by paused sequences and "
                "nothing can move; add CPU or NVMe capacity or lower max_num_seqs"
            )
        self._num_stalled = 0
        output = self._execute(plan)
        done_s = backend.now_s()
        finished = scheduler.complete(plan, output.sampled, done_s, failed=output.failed)
        if output.failed:
            self._check_contained(output.failed)
        this_step_s = backend.now_s() - step_start_s
        self.step_s += this_step_s
        self.swap_wait_s += plan.swap_wait_s
        self.num_steps += 1
        if self._observers:
            sample = sample_step(
                scheduler, plan, finished, t_s=done_s, step_s=this_step_s,
                step_total_s=self.step_s, swap_wait_total_s=self.swap_wait_s,
            )  # fmt: skip
            for observer in self._observers:
                observer.on_step(sample)
        if self._listener is not None:
            self._listener(plan, output, finished)
        for seq_id in finished:
            self.arrivals.finished(seq_id, scheduler.runs[seq_id].output_ids, done_s)
        self._report_progress()
        return True

    def _execute(self, plan: StepPlan) -> StepOutput:
        """The step's output; if the step fails, each request is run alone, and those that
        fail alone are marked failed (`StepOutput.failed`: they abort, the rest go on)."""
        try:
            return self.backend.execute(plan)
        except Exception as error:
            if len(plan.seqs) == 1:
                return StepOutput({}, failed={plan.seqs[0].seq_id: failure_reason(error)})
        sampled: dict[int, int] = {}
        failed: dict[int, str] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        for item in plan.seqs:
            try:
                alone = self.backend.execute(StepPlan(plan.step, (item,), 0.0))
            except Exception as error:
                failed[item.seq_id] = failure_reason(error)
                continue
            sampled.update(alone.sampled)
            failed.update(alone.failed)
            logprobs.update(alone.logprobs)
        return StepOutput(sampled, failed, logprobs)

    def _end_aborted(self, aborted: Sequence[int], now_s: float) -> None:
        """Requests the scheduler aborted while planning (the failure rule): check that
        it could, and tell whoever waits for them."""
        scheduler = self.control.scheduler
        self._check_contained(aborted)
        if self._listener is not None:  # a step that produced nothing but these ends
            self._listener(StepPlan(scheduler.step, (), 0.0), StepOutput({}), aborted)
        for seq_id in aborted:
            self.arrivals.finished(seq_id, scheduler.runs[seq_id].output_ids, now_s)

    def _check_contained(self, failed: Collection[int]) -> None:
        """Requests failed and were aborted: the run goes on only if the control plane's
        invariants still hold (no block lost its owner, no count went wrong)."""
        try:
            self.control.swapper.check_integrity()
        except AssertionError as broken:
            first = min(failed)
            reason = self.control.scheduler.runs[first].abort_reason
            raise KvSwapError(
                f"the run cannot go on after request {first} failed ({reason}): the KV "
                f"store's state is inconsistent ({broken})"
            ) from broken

    def _report_progress(self) -> None:
        if self._progress is not None:
            self._progress(len(self.control.scheduler.finished), self._num_requests())

    def summary(self) -> RunSummary:
        """Drain the transfers in flight; the run's summary (observers see its JSON)."""
        self.control.swapper.drain()
        self._report_progress()
        duration_s = self.backend.now_s()
        summary = build_summary(
            self.control.scheduler,
            duration_s,
            StepTotals(self.num_steps, self.step_s, self.swap_wait_s),
            self.backend.summary_extras(duration_s),
        )
        summary_json = summary.to_json()
        for observer in self._observers:
            observer.on_finish(summary_json)
        return summary


def drive(
    control: ControlPlane,
    backend: Backend,
    workload: Workload,
    *,
    progress: RequestProgress | None = None,
    observers: Sequence[StepObserver] = (),
    sampling: SamplingParams | None = None,
) -> RunSummary:
    """Serve every request of `workload`, each with `sampling` (None: greedy); each
    observer sees every step's sample, then the summary's JSON object."""
    driver = Driver(
        control, backend, ArrivalQueue(workload, sampling),
        num_requests=lambda: len(workload),
        progress=progress, observers=observers,
    )  # fmt: skip
    while driver.step():
        pass
    return driver.summary()
