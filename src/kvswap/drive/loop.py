"""THE driver loop: arrivals -> schedule -> execute -> complete -> observe -> progress.

One loop for the engine and the simulator (they differ only in the Backend):

    while requests remain:
        admit arrivals that are due
        nothing to run?        idle until the next arrival
        plan = schedule()      swap-ins started and waited for
        empty plan?            wait for a transfer, idle until an arrival, or retry
        sampled = backend.execute(plan)
        complete(plan)         outputs appended; offload; swap-out past the watermark
        observers, progress
    drain transfers; summary

The retry rule: an empty plan with nothing moving and no arrival to wait for
is retried while a retry can help (each `schedule` may have dropped a paused
sequence's KV in its recompute fallback after its last attempt), then the
run stops with a one-line error.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.drive.assembly import ControlPlane
from kvswap.drive.backend import Backend
from kvswap.drive.summary import RunSummary, StepTotals, build_summary
from kvswap.errors import KvSwapError
from kvswap.obs.observer import StepObserver, sample_step
from kvswap.progress import RequestProgress
from kvswap.workload.arrivals import ArrivalQueue
from kvswap.workload.request import Workload


def drive(
    control: ControlPlane,
    backend: Backend,
    workload: Workload,
    *,
    progress: RequestProgress | None = None,
    observers: Sequence[StepObserver] = (),
) -> RunSummary:
    """Serve every request of `workload`; each observer sees every step's sample,
    then the summary's JSON object."""
    scheduler, swapper = control.scheduler, control.swapper
    arrivals = ArrivalQueue(workload)
    backend.start()
    step_s = swap_wait_s = 0.0
    num_steps = num_stalled = 0
    while arrivals or scheduler.has_work():
        now_s = backend.now_s()
        arrivals.admit_due(scheduler, now_s)
        next_s = arrivals.next_arrival_s()
        if not scheduler.has_work():
            if next_s is not None:
                backend.idle_until(next_s)
            continue
        step_start_s = backend.now_s()
        plan = scheduler.schedule(now_s)
        if not plan.seqs:
            if swapper.wait_any():
                continue  # a transfer finished: room may have appeared
            if next_s is not None and next_s > now_s:
                backend.idle_until(next_s)
                continue
            num_stalled += 1
            if num_stalled <= len(scheduler.preempted) + len(scheduler.running) + 1:
                continue
            raise KvSwapError(
                "the run cannot make progress: the GPU tier is held by paused sequences and "
                "nothing can move; add CPU or NVMe capacity or lower max_num_seqs"
            )
        num_stalled = 0
        sampled = backend.execute(plan)
        done_s = backend.now_s()
        finished = scheduler.complete(plan, sampled, done_s)
        this_step_s = backend.now_s() - step_start_s
        step_s += this_step_s
        swap_wait_s += plan.swap_wait_s
        num_steps += 1
        if observers:
            sample = sample_step(
                scheduler, plan, finished, t_s=done_s, step_s=this_step_s,
                step_total_s=step_s, swap_wait_total_s=swap_wait_s,
            )  # fmt: skip
            for observer in observers:
                observer.on_step(sample)
        for seq_id in finished:
            arrivals.finished(seq_id, scheduler.runs[seq_id].output_ids, done_s)
        if progress is not None:
            progress(len(scheduler.finished), len(workload))
    swapper.drain()
    if progress is not None:
        progress(len(scheduler.finished), len(workload))
    duration_s = backend.now_s()
    summary = build_summary(
        scheduler,
        duration_s,
        StepTotals(num_steps, step_s, swap_wait_s),
        backend.summary_extras(duration_s),
    )
    summary_json = summary.to_json()
    for observer in observers:
        observer.on_finish(summary_json)
    return summary
