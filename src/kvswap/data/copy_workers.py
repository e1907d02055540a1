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

CPU path (no GPU): a lane runs its chunk as one batch on the engine's
`CopyCrew` (`CpuChunk`, below). With the device pool on the CPU, the crew's
helper threads take blocks of the same chunk too, each block one memcpy that
releases the GIL, so a chunk moves on every core. The lane moves on to its
next chunk once nothing of this one is left to take, and whichever thread
copies a chunk's last block reports it. A LOW copy thread, before each 512 KiB
piece of a block, yields while any HIGH chunk is pending or running, so on the
shared memory bus a swap-in waits for at most one LOW piece per copy thread.

CUDA path (the device pool on a GPU): a lane issues a chunk
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
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvswap.base.transfer import Priority, TransferResult
from kvswap.data import block_copy
from kvswap.data.block_copy import Job, Pools, error_text, failed_result
from kvswap.data.copy_crew import BatchOutcome, CopyCrew
from kvswap.data.link_arbiter import LinkArbiter

_EXITED = "copy worker exited"
_MAX_ERRORS_IN_TEXT = 3


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
            if lane is None:
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
            if lane is not None:
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


class CpuChunk:
    """One chunk started on `crew`; `report(job, result)` runs once, when its last
    block is copied or lost. `yield_to`: a LOW chunk's arbiter, None for HIGH.

        lane thread                      crew helper(s)
        CpuChunk(job_k)  -- post -->     join batch k
          copy its blocks                copy its blocks
          nothing left to take: return   last block of k lands: report k (future set)
        CpuChunk(job_k+1) -- post -->    join batch k+1 without going to sleep
        finish(k): wait() -> nothing of k is touched any more

    The lane returns as soon as no block of the chunk is left to take, so it starts
    its next chunk while a helper copies the last blocks of this one; the chunk's
    result is set by whichever thread copies last, at that moment, so it is reported
    as early as if the lane had waited. `wait()` is the lane's check that no thread
    touches the chunk any more (before it exits, or drops it from what it holds).
    Its blocks (the device pool in host memory) spread over the crew (a LOW one's
    blocks in pieces, see copy_crew). A copy that raises stops the chunk: that block
    and every one not yet copied are lost (copy_crew)."""

    def __init__(
        self,
        job: Job,
        pools: Pools,
        crew: CopyCrew,
        *,
        yield_to: LinkArbiter | None,
        report: Callable[[Job, TransferResult], None],
    ) -> None:
        self.job = job
        self._start_s = time.perf_counter()
        chunk = job.chunk
        direction = chunk.direction

        def copy(src_slot: int, dst_slot: int) -> None:
            # Looked up at call time: tests replace it to inject faults and hooks.
            block_copy.copy_block(pools, direction, src_slot, dst_slot)

        block_bytes = chunk.num_bytes // chunk.num_blocks

        def copy_piece(src_slot: int, dst_slot: int, piece: int, num_pieces: int) -> None:
            start_byte = piece * block_bytes // num_pieces
            stop_byte = (piece + 1) * block_bytes // num_pieces
            block_copy.copy_block(
                pools, direction, src_slot, dst_slot, byte_range=(start_byte, stop_byte)
            )

        self._batch = crew.start(
            list(zip(chunk.src_slots, chunk.dst_slots, strict=True)),
            copy,
            num_bytes=chunk.num_bytes,
            yield_to=yield_to,
            on_done=lambda outcome, end_s: report(job, self._result(outcome, end_s)),
            copy_piece=copy_piece,
        )

    @property
    def done(self) -> bool:
        """True once no thread touches the chunk (and it has been reported)."""
        return self._batch.done.is_set()

    def wait(self) -> TransferResult:
        """Block until no thread touches the chunk; its result."""
        return self._result(*self._batch.wait())

    def _result(self, outcome: BatchOutcome, end_s: float) -> TransferResult:
        chunk = self.job.chunk
        return TransferResult(
            transfer_id=chunk.transfer_id,
            success=not outcome.failed_dst_slots,
            num_bytes=chunk.num_bytes,
            start_s=self._start_s,
            end_s=end_s,
            error=_join_errors(outcome.errors),
            failed_dst_slots=outcome.failed_dst_slots,
        )


def _join_errors(errors: tuple[str, ...]) -> str | None:
    if not errors:
        return None
    text = "; ".join(errors[:_MAX_ERRORS_IN_TEXT])
    if len(errors) > _MAX_ERRORS_IN_TEXT:
        text += f"; and {len(errors) - _MAX_ERRORS_IN_TEXT} more"
    return text


class CudaChunk:
    """One chunk issued on `stream`, at once; `wait()` blocks until its end event is
    reached.

        lane thread                           copy stream (HIGH or LOW priority)
        CudaChunk(job) -- wait(ready_event) -> [ready]
                       -- record(start)     -> [start]
                       -- copy_ x num_blocks-> [blk][blk][blk]...   (non_blocking)
                       -- record(end)       -> [end]
        .wait()  ------- end.synchronize() <-- end reached (a blocking event: sleeps)

    Each block is one `copy_(non_blocking=True)` between the device pool and a
    page-locked host slot, so it is a real asynchronous DMA. The chunk's duration is
    the GPU's own (start/end events); several chunks can be in flight on one stream
    and each one's events still time only its own copies."""

    def __init__(self, job: Job, pools: Pools, stream: torch.cuda.Stream) -> None:
        self.job = job
        self.issue_s = time.perf_counter()
        self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        # blocking: the worker waiting in wait() sleeps instead of spinning on a core
        # that the engine's own thread needs to queue the next step.
        self._end = torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]
        chunk = job.chunk
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                if job.ready_event is not None:
                    # The copy must see every kernel queued before submit() on the
                    # caller's stream (the one that wrote, or still reads, the block).
                    stream.wait_event(job.ready_event)
                self._start.record(stream)
                for src_slot, dst_slot in zip(chunk.src_slots, chunk.dst_slots, strict=True):
                    block_copy.copy_block(
                        pools, chunk.direction, src_slot, dst_slot, non_blocking=True
                    )
                self._end.record(stream)
        except BaseException:
            # Copies already queued still write their slots: let them land before
            # the caller reports the chunk failed and the slots get reused.
            stream.synchronize()
            raise

    def wait(self) -> TransferResult:
        """Block until the chunk's last copy is done; its result, timed by the GPU."""
        self._end.synchronize()
        end_s = time.perf_counter()
        elapsed_s = self._start.elapsed_time(self._end) / 1000.0
        chunk = self.job.chunk
        return TransferResult(
            transfer_id=chunk.transfer_id,
            success=True,
            num_bytes=chunk.num_bytes,
            start_s=max(self.issue_s, end_s - elapsed_s),
            end_s=end_s,
        )
