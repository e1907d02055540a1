"""The threads behind `LocalCopyEngine`: one worker per priority queue.

    control thread             HIGH worker                    LOW worker
    submit(HIGH) -- arbiter.high_submitted()
                   --------->  chunk: copy, copy, copy        before each block:
                               arbiter.high_finished() ---->  wait_until_no_high()
                               future.set_result(...)          copy one block

CPU path (no GPU, and every NVMe leg): the worker copies block by block itself
(tensor copies and file I/O release the GIL). A LOW worker, before each
block, yields while any HIGH chunk is pending or running, so on the shared
memory bus / disk a swap-in waits for at most one LOW block.

CUDA path (GPU legs when the device pool is on a GPU): the worker issues a
chunk on its queue's stream (`CudaChunk`) and keeps up to `max_in_flight`
chunks queued there before waiting for the oldest. LOW runs with one in
flight: its next chunk is issued only after the previous one finished, so a
HIGH chunk never queues behind more than one LOW chunk on the copy engines.
HIGH may keep several in flight so back-to-back swap-ins leave no gap.

A worker never dies with a waiter: whatever a copy raises becomes a failed
`TransferResult` carrying the error text.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Protocol

import torch

from kvswap.control.transfer import Priority, TransferChunk, TransferResult
from kvswap.data import block_copy
from kvswap.data.block_copy import GPU_DIRECTIONS, Job, Pools, error_text, failed_result
from kvswap.data.cuda_copies import CudaChunk
from kvswap.data.disk_pool import DiskSlotError

_MAX_ERRORS_IN_TEXT = 3


class LinkArbiter:
    """Counts HIGH chunks pending or running; LOW block copies wait while any exist."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_high = 0

    def high_submitted(self) -> None:
        with self._cond:
            self._num_high += 1

    def high_finished(self) -> None:
        with self._cond:
            self._num_high -= 1
            if self._num_high == 0:
                self._cond.notify_all()

    def wait_until_no_high(self) -> None:
        with self._cond:
            while self._num_high > 0:
                self._cond.wait()


class _Started(Protocol):
    """A job whose copies have been issued; `wait()` returns its result."""

    job: Job

    def wait(self) -> TransferResult: ...


class _Finished:
    """A job that ran synchronously (CPU path) or failed to start."""

    def __init__(self, job: Job, result: TransferResult) -> None:
        self.job = job
        self._result = result

    def wait(self) -> TransferResult:
        return self._result


class QueueWorker:
    """One priority queue: a FIFO of jobs and the thread that runs them in order."""

    def __init__(
        self,
        priority: Priority,
        pools: Pools,
        arbiter: LinkArbiter,
        stream: torch.cuda.Stream | None,
        max_in_flight: int,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.priority = priority
        self._pools = pools
        self._arbiter = arbiter
        self._stream = stream
        self._max_in_flight = max_in_flight
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"kvswap-copy-{priority.name.lower()}", daemon=True
        )
        self._thread.start()

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Finish the jobs already queued, then exit."""
        self._jobs.put(None)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        in_flight: deque[_Started] = deque()
        while True:
            try:
                # Block for new work only when nothing is in flight.
                job = self._jobs.get(block=not in_flight)
            except queue.Empty:
                self._finish(in_flight.popleft())
                continue
            if job is None:
                while in_flight:
                    self._finish(in_flight.popleft())
                return
            if not self._runs_on_stream(job):
                while in_flight:  # report earlier chunks before a long synchronous one
                    self._finish(in_flight.popleft())
            in_flight.append(self._start(job))
            while len(in_flight) >= self._max_in_flight or (
                in_flight and isinstance(in_flight[-1], _Finished)
            ):
                self._finish(in_flight.popleft())

    def _runs_on_stream(self, job: Job) -> bool:
        return self._stream is not None and job.chunk.direction in GPU_DIRECTIONS

    def _start(self, job: Job) -> _Started:
        start_s = time.perf_counter()
        try:
            if self._stream is not None and self._runs_on_stream(job):
                return CudaChunk(job, self._pools, self._stream)
            return _Finished(job, self._run_blocks(job.chunk))
        except BaseException as exc:  # last resort: never leave a waiter hanging
            return _Finished(job, failed_result(job.chunk, start_s, error_text(exc)))

    def _finish(self, started: _Started) -> None:
        job = started.job
        try:
            result = started.wait()
        except BaseException as exc:
            # An asynchronous copy failed: no block of the chunk can be trusted.
            result = failed_result(job.chunk, time.perf_counter(), error_text(exc))
        finally:
            if self.priority is Priority.HIGH:
                self._arbiter.high_finished()
        job.future.set_result(result)

    def _run_blocks(self, chunk: TransferChunk) -> TransferResult:
        """CPU path: block by block; a LOW worker yields to HIGH before each block."""
        start_s = time.perf_counter()
        failed_dst_slots: list[int] = []
        errors: list[str] = []
        slot_pairs = zip(chunk.src_slots, chunk.dst_slots, strict=True)
        for index, (src_slot, dst_slot) in enumerate(slot_pairs):
            if self.priority is Priority.LOW:
                self._arbiter.wait_until_no_high()
            try:
                block_copy.copy_block(self._pools, chunk.direction, src_slot, dst_slot)
            except DiskSlotError as exc:
                # One bad NVMe slot loses one block; the rest of the chunk goes on.
                failed_dst_slots.append(dst_slot)
                errors.append(str(exc))
            except Exception as exc:
                # Unknown failure: this block and the ones not yet copied are lost.
                failed_dst_slots.extend(chunk.dst_slots[index:])
                errors.append(error_text(exc))
                break
        end_s = time.perf_counter()
        return TransferResult(
            transfer_id=chunk.transfer_id,
            success=not failed_dst_slots,
            num_bytes=chunk.num_bytes,
            start_s=start_s,
            end_s=end_s,
            error=_join_errors(errors),
            failed_dst_slots=tuple(failed_dst_slots),
        )


def _join_errors(errors: list[str]) -> str | None:
    if not errors:
        return None
    text = "; ".join(errors[:_MAX_ERRORS_IN_TEXT])
    if len(errors) > _MAX_ERRORS_IN_TEXT:
        text += f"; and {len(errors) - _MAX_ERRORS_IN_TEXT} more"
    return text
