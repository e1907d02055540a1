"""A chunk on a CUDA copy stream: issued at once, finished when its event is.

    worker thread                         copy stream (HIGH or LOW priority)
    CudaChunk(job) -- wait(ready_event) -> [ready]
                   -- record(start)     -> [start]
                   -- copy_ x num_blocks-> [blk][blk][blk]...   (non_blocking)
                   -- record(end)       -> [end]
    .wait()  ------- end.synchronize() <-- end reached (a blocking event: sleeps)

Each block is one `copy_(non_blocking=True)` between the device pool and a
page-locked host slot, so it is a real asynchronous DMA. The chunk's duration
is the GPU's own (start/end events); several chunks can be in flight on one
stream and each one's events still time only its own copies.
"""

from __future__ import annotations

import time

import torch

from kvswap.base.transfer import TransferResult
from kvswap.data import block_copy
from kvswap.data.block_copy import Job, Pools


class CudaChunk:
    """One chunk issued on `stream`; `wait()` blocks until it has finished."""

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
