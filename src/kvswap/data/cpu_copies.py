"""A chunk on the CPU path: one batch on the copy crew, reported by its last thread.

    lane thread                      crew helper(s)
    CpuChunk(job_k)  -- post -->     join batch k
      copy its blocks                copy its blocks
      nothing left to take: return   last block of k lands: report k (future set)
    CpuChunk(job_k+1) -- post -->    join batch k+1 without going to sleep
    finish(k): wait() -> nothing of k is touched any more

The lane returns as soon as no block of the chunk is left to take, so it
starts its next chunk while a helper copies the last blocks of this one; the
chunk's result is set by whichever thread copies last, at that moment, so it
is reported as early as if the lane had waited. `wait()` is the lane's check
that no thread touches the chunk any more (before it exits, or drops it from
what it holds). GPU legs (the device pool in host memory) spread over the
crew (a LOW one's blocks in pieces, see copy_crew); NVMe legs stay on the lane,
block by block. Errors are per block:
`DiskSlotError` loses that block; anything else stops the chunk (copy_crew).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvswap.base.transfer import TransferResult
from kvswap.data import block_copy
from kvswap.data.block_copy import GPU_DIRECTIONS, Job, Pools
from kvswap.data.copy_crew import BatchOutcome, CopyCrew
from kvswap.data.disk_pool import DiskSlotError
from kvswap.data.link_arbiter import LinkArbiter

_MAX_ERRORS_IN_TEXT = 3


class CpuChunk:
    """One chunk started on `crew`; `report(job, result)` runs once, when its last
    block is copied or lost. `yield_to`: a LOW chunk's arbiter, None for HIGH."""

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

        def copy(src_slot: int, dst_slot: int) -> str | None:
            try:
                # Looked up at call time: tests replace it to inject faults and hooks.
                block_copy.copy_block(pools, direction, src_slot, dst_slot)
            except DiskSlotError as exc:
                return str(exc)  # one bad NVMe slot loses one block; the chunk goes on
            return None

        block_bytes = chunk.num_bytes // chunk.num_blocks

        def copy_piece(src_slot: int, dst_slot: int, piece: int, num_pieces: int) -> str | None:
            start_byte = piece * block_bytes // num_pieces
            stop_byte = (piece + 1) * block_bytes // num_pieces
            block_copy.copy_block(
                pools, direction, src_slot, dst_slot, byte_range=(start_byte, stop_byte)
            )
            return None

        self._batch = crew.start(
            list(zip(chunk.src_slots, chunk.dst_slots, strict=True)),
            copy,
            num_bytes=chunk.num_bytes,
            yield_to=yield_to,
            spread=direction in GPU_DIRECTIONS,
            on_done=lambda outcome, end_s: report(job, self._result(outcome, end_s)),
            copy_piece=copy_piece,  # GPU legs only (spread): no NVMe slot is split
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
