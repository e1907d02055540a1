"""One modelled copy link (one copy engine): two priority queues sharing a wire.

    submit --> HIGH queue (swap-in, prefetch) --+
                                                +--> link: one job at a time
    submit --> LOW queue  (swap-out, demote)  --+

When the link frees up it takes the oldest HIGH job, else the oldest LOW one.
A job holds the link for `overhead_s + num_bytes / bytes_per_s` (times a
jitter factor >= 1 for pageable memory). A started job is never preempted, as
a DMA transfer is not: a HIGH job that arrives while a LOW chunk holds the
link waits for that whole chunk. That is why a 1 GiB swap-out chunk delays
swap-ins by ~40 ms on PCIe 4.0 and a 16 MiB one by under a millisecond.
The owner decides what shares a link: with one copy engine for both
directions the swap-outs and the swap-ins are submitted to the same `Link`.

`yields_per_block` models kvswap's CPU copy engine instead: its LOW worker
checks for HIGH work before every block, so a LOW job runs as per-block
slices and a waiting HIGH job takes the link between two slices.

With `high_streams` >= 2, a HIGH job queued behind another HIGH job issues
its copy on a second stream while the first is still moving data, so its
fixed overhead overlaps that data phase (up to the length of that phase);
more streams change nothing more in this model: the wire is the bottleneck.

Events are processed lazily: the owner calls `advance(now_s)` before reading
or submitting, and `finish(job)` to run the link forward to a job's end
(nothing else can be submitted meanwhile: the caller is blocked in a wait).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvswap.base.transfer import Priority, TransferChunk


@dataclass
class LinkJob:
    chunk: TransferChunk
    submit_s: float
    overhead_s: float
    data_s: float  # bytes / bandwidth x jitter factor
    num_slices: int  # 1, or one per block when a LOW job yields between blocks
    slices_done: int = 0
    start_s: float | None = None
    end_s: float | None = None
    blocked_high_s: float = 0.0  # LOW job: longest wait it imposed on a HIGH job


class Link:
    def __init__(self, name: str, *, high_streams: int = 1, yields_per_block: bool = False):
        self.name = name
        self.high_streams = high_streams
        self.yields_per_block = yields_per_block
        self._queues: dict[Priority, deque[LinkJob]] = {p: deque() for p in Priority}
        self._current: LinkJob | None = None
        self._current_end_s = 0.0
        self._last_high_data_s: float | None = None  # data phase of a HIGH job ending now
        self.busy_s = 0.0
        self.finished: list[LinkJob] = []  # completed, not yet collected by the owner

    def submit(self, job: LinkJob, now_s: float) -> None:
        self.advance(now_s)
        if self.yields_per_block and job.chunk.priority is Priority.LOW:
            job.num_slices = max(1, job.chunk.num_blocks)
        current = self._current
        high = job.chunk.priority is Priority.HIGH
        if high and current is not None and current.chunk.priority is Priority.LOW:
            # A DMA chunk runs to its end: the HIGH job waits for it.
            current.blocked_high_s = max(current.blocked_high_s, self._current_end_s - now_s)
        self._queues[job.chunk.priority].append(job)
        if self._current is None:
            self._last_high_data_s = None  # the link was idle: nothing to overlap with
            self._start_next(now_s)

    def advance(self, now_s: float) -> None:
        """Process every slice that ends at or before `now_s`."""
        while self._current is not None and self._current_end_s <= now_s:
            self._end_slice()

    def finish(self, job: LinkJob) -> float:
        """Run the link forward until `job` is done; returns its end time."""
        while job.end_s is None:
            if self._current is None:
                raise AssertionError(f"{self.name}: job {job.chunk.transfer_id} is not queued")
            self._end_slice()
        return job.end_s

    def drain(self) -> float | None:
        """Run every queued job to its end; the time the link goes idle (None: was idle)."""
        end_s = None
        while self._current is not None:
            end_s = self._current_end_s
            self._end_slice()
        return end_s

    def _end_slice(self) -> None:
        job = self._current
        assert job is not None
        now_s = self._current_end_s
        job.slices_done += 1
        self._current = None
        if job.slices_done == job.num_slices:
            job.end_s = now_s
            self.finished.append(job)
            high = job.chunk.priority is Priority.HIGH
            self._last_high_data_s = job.data_s if high else None
        elif self._queues[Priority.HIGH]:
            self._queues[Priority.LOW].appendleft(job)  # yield between two blocks
            self._last_high_data_s = None
        else:
            self._run(job, now_s)
            return
        self._start_next(now_s)

    def _start_next(self, now_s: float) -> None:
        for priority in Priority:  # HIGH first
            queue = self._queues[priority]
            if queue:
                self._run(queue.popleft(), now_s)
                return

    def _run(self, job: LinkJob, now_s: float) -> None:
        duration_s = job.data_s / job.num_slices
        if job.start_s is None:
            job.start_s = now_s
            overhead_s = job.overhead_s
            previous = self._last_high_data_s
            if job.chunk.priority is Priority.HIGH and self.high_streams > 1 and previous:
                overhead_s = max(0.0, overhead_s - previous)
            duration_s += overhead_s
        self._current = job
        self._current_end_s = now_s + duration_s
        self.busy_s += duration_s
