"""The threads behind `LocalCopyEngine`: one queue per priority, a thread per lane.

    control thread             HIGH lanes (1..8 threads)      LOW lane (1 thread)
    submit(HIGH) -- arbiter.high_submitted()
                   --------->  one FIFO, each lane takes the  before each block:
                               next chunk: copy, copy, copy   wait_until_no_high()
                               arbiter.high_finished() ---->  copy one block
                               future.set_result(...)

A lane is a thread with (CUDA) its own copy stream. HIGH has
`prefetch_streams` lanes sharing one FIFO, so that many swap-in / prefetch
chunks move at once; LOW has one. The control plane never submits a chunk
whose source is another pending chunk's destination (a source must be a
ready copy), so HIGH chunks may finish in any order.

CPU path (no GPU, and every NVMe leg): a lane runs its chunk as one batch on
the engine's `CopyCrew` (`CpuChunk`, cpu_copies.py). With the device pool on
the CPU, the crew's helper threads take blocks of the same chunk too, each
block one memcpy that releases the GIL, so a chunk moves on every core; NVMe
legs stay on their lane. The lane moves on to its next chunk once nothing of
this one is left to take, and whichever thread copies a chunk's last block
reports it. A LOW copy thread, before each block (each 512 KiB piece of a GPU
leg's block), yields while any HIGH chunk is pending or running, so on the
shared memory bus / disk a swap-in waits for at most one LOW piece (an NVMe
leg: one block) per copy thread.

CUDA path (GPU legs when the device pool is on a GPU): a lane issues a chunk
on its stream (`CudaChunk`) and keeps up to `max_in_flight` chunks queued
there before waiting for the oldest. LOW runs with one in flight: its next
chunk is issued only after the previous one finished, so a HIGH chunk never
queues behind more than one LOW chunk on the copy engines.

Lanes sleep on the queue (or on a CUDA event) when idle; none spins. A lane
never dies with a waiter: whatever a copy raises becomes a failed
`TransferResult` carrying the error text, and if a lane's thread dies anyway
(a bug), it fails the chunks it held; the last lane of a queue to go fails
everything still queued, so no waiter and no yielding LOW block hangs.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from kvswap.base.transfer import Priority, TransferResult
from kvswap.data.block_copy import GPU_DIRECTIONS, Job, Pools, error_text, failed_result
from kvswap.data.copy_crew import CopyCrew
from kvswap.data.cpu_copies import CpuChunk
from kvswap.data.cuda_copies import CudaChunk
from kvswap.data.link_arbiter import LinkArbiter

_EXITED = "copy worker exited"


class _Started(Protocol):
    """A job whose copies have been issued; `wait()` returns its result."""

    job: Job

    def wait(self) -> TransferResult: ...


class _Finished:
    """A job that failed to start."""

    def __init__(self, job: Job, result: TransferResult) -> None:
        self.job = job
        self._result = result

    def wait(self) -> TransferResult:
        return self._result


class QueueWorker:
    """One priority queue: a FIFO of jobs and one thread per lane taking from it.

    `lanes`: one entry per thread, its CUDA stream, or None for a thread that
    copies on the CPU itself. `max_in_flight`: per lane, chunks issued on its
    stream before it waits for the oldest (CUDA path only)."""

    def __init__(
        self,
        priority: Priority,
        pools: Pools,
        arbiter: LinkArbiter,
        lanes: Sequence[torch.cuda.Stream | None],
        max_in_flight: int,
        crew: CopyCrew | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not lanes:
            raise ValueError("a queue worker needs at least one lane")
        self.priority = priority
        self._pools = pools
        self._arbiter = arbiter
        # The CPU path's copy threads; without one, every block runs on its lane.
        self._crew = crew if crew is not None else CopyCrew(0, min_spread_bytes=0)
        self._max_in_flight = max_in_flight
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Guards _num_running against put(): a job is either queued while a lane
        # still runs, or failed at once; never stranded in a queue nobody reads.
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()  # one report per job, whichever thread
        self._num_running = len(lanes)
        name = priority.name.lower()
        self._threads = [
            threading.Thread(
                target=self._serve, args=(lane,), name=f"kvswap-copy-{name}-{index}", daemon=True
            )
            for index, lane in enumerate(lanes)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_lanes(self) -> int:
        return len(self._threads)

    def put(self, job: Job) -> None:
        with self._lock:
            if self._num_running > 0:
                self._jobs.put(job)
                return
            self._settle(job, failed_result(job.chunk, time.perf_counter(), _EXITED), None)

    def is_alive(self) -> bool:
        """True while any lane's thread runs."""
        return any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """Finish the jobs already queued, then exit: one end marker per lane, after
        every job, and a lane exits on the first it takes."""
        for _thread in self._threads:
            self._jobs.put(None)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _serve(self, lane: torch.cuda.Stream | None) -> None:
        held: list[Job] = []  # taken from the queue by this lane, result not yet set
        in_flight: deque[_Started] = deque()  # started, not yet finished by this lane
        reason = _EXITED
        try:
            self._run(lane, held, in_flight)
        except BaseException as exc:
            # Only the type: str(exc) is what may have failed in the first place.
            reason = f"{_EXITED} ({type(exc).__name__})"
            raise
        finally:
            self._exit(held, in_flight, reason)

    def _exit(self, held: list[Job], in_flight: deque[_Started], reason: str) -> None:
        for started in in_flight:
            if isinstance(started, CpuChunk):
                # Its helpers still write its slots: let them land first.
                with contextlib.suppress(BaseException):
                    started.wait()
        now_s = time.perf_counter()
        for job in list(held):
            self._settle(job, failed_result(job.chunk, now_s, reason), held)
        with self._lock:
            self._num_running -= 1
            if self._num_running > 0:
                return
            # The last lane is gone: nothing will take what is still queued.
            while True:
                try:
                    queued = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if queued is not None:
                    self._settle(queued, failed_result(queued.chunk, now_s, reason), None)

    def _settle(self, job: Job, result: TransferResult, held: list[Job] | None) -> None:
        """This lane is done with `job`: out of `held`, and reported if it was not yet."""
        if held is not None:
            held.remove(job)
        self._report(job, result)

    def _report(self, job: Job, result: TransferResult) -> None:
        """Report `job` exactly once: off the arbiter, result set. Any thread: the
        copy crew's last thread out reports a CPU chunk before its lane settles it."""
        with self._report_lock:
            if job.future.done():
                return
            if self.priority is Priority.HIGH:
                self._arbiter.high_finished()
            job.future.set_result(result)

    def _run(
        self, lane: torch.cuda.Stream | None, held: list[Job], in_flight: deque[_Started]
    ) -> None:
        while True:
            try:
                # Block for new work only when nothing is in flight.
                job = self._jobs.get(block=not in_flight)
            except queue.Empty:
                self._finish(in_flight.popleft(), held)
                continue
            if job is None:
                while in_flight:
                    self._finish(in_flight.popleft(), held)
                return
            held.append(job)
            if not _runs_on_stream(job, lane):
                # Report earlier stream chunks before a long synchronous one (a
                # crew chunk has reported itself, or will when its last block lands).
                while in_flight and not isinstance(in_flight[0], CpuChunk):
                    self._finish(in_flight.popleft(), held)
            started = self._start(job, lane)
            in_flight.append(started)
            if isinstance(started, CpuChunk) and not started.done:
                # Only it stays in flight: the next chunk starts while a helper
                # copies its last blocks, and the helper moves on to that one.
                while len(in_flight) > 1:
                    self._finish(in_flight.popleft(), held)
                continue
            while len(in_flight) >= self._max_in_flight or (
                in_flight and isinstance(in_flight[-1], (_Finished, CpuChunk))
            ):
                self._finish(in_flight.popleft(), held)

    def _start(self, job: Job, lane: torch.cuda.Stream | None) -> _Started:
        start_s = time.perf_counter()
        try:
            if lane is not None and _runs_on_stream(job, lane):
                return CudaChunk(job, self._pools, lane)
            yield_to = self._arbiter if self.priority is Priority.LOW else None
            return CpuChunk(job, self._pools, self._crew, yield_to=yield_to, report=self._report)
        except BaseException as exc:  # last resort: never leave a waiter hanging
            return _Finished(job, failed_result(job.chunk, start_s, error_text(exc)))

    def _finish(self, started: _Started, held: list[Job]) -> None:
        try:
            result = started.wait()
        except BaseException as exc:
            # An asynchronous copy failed: no block of the chunk can be trusted.
            result = failed_result(started.job.chunk, time.perf_counter(), error_text(exc))
        self._settle(started.job, result, held)


def _runs_on_stream(job: Job, lane: torch.cuda.Stream | None) -> bool:
    return lane is not None and job.chunk.direction in GPU_DIRECTIONS
