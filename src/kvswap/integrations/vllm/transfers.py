"""vLLM's transfer jobs on kvswap's copy engine: each job cut into bounded chunks.

vLLM's worker hands over jobs (a job id, GPU blocks, host chunks) and polls for
finished job ids; kvswap's `LocalCopyEngine` moves chunks of slots on two
queues. This is the bookkeeping between the two, vLLM-free:

    load  (host -> device)  CPU_TO_GPU on HIGH, chunks of swap_in_chunk_blocks blocks
    store (device -> host)  GPU_TO_CPU on LOW,  chunks of swap_out_chunk_blocks blocks

A chunk holds whole blocks (every tensor's page of a block), so the LOW lane,
which yields to HIGH before every page, lets a load pass a store after at most
one page. A job is finished when all its chunks are; it failed if any chunk
did. Results are reported once, by `finished()`, also for jobs `wait` waited on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvswap.base.transfer import CopyEngine, Direction, Priority, TransferChunk, TransferResult


@dataclass(frozen=True)
class JobDone:
    """A finished job: its bytes and the seconds from its first chunk's start to its
    last chunk's end (the engine's clock)."""

    job_id: int
    success: bool
    num_bytes: int
    transfer_time_s: float
    error: str | None = None  # why it failed: the first chunk error


@dataclass(frozen=True)
class TransferCounts:
    """Finished jobs and their bytes since the worker started, by direction."""

    num_loads: int = 0
    loaded_bytes: int = 0
    num_stores: int = 0
    stored_bytes: int = 0
    num_failed: int = 0


@dataclass
class _Job:
    pending: set[int]  # transfer ids not yet finished
    is_load: bool
    num_bytes: int = 0
    success: bool = True
    start_s: float | None = None
    end_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class PagedTransfers:
    """Jobs of page pairs on a `CopyEngine` whose slots are pages (`pages.py`)."""

    def __init__(
        self,
        engine: CopyEngine,
        page_bytes: int,
        pages_per_block: int,
        *,
        swap_in_chunk_blocks: int,
        swap_out_chunk_blocks: int,
    ) -> None:
        self.engine = engine
        self.page_bytes = page_bytes
        self.pages_per_block = pages_per_block
        self._chunk_pages = {
            Priority.HIGH: swap_in_chunk_blocks * pages_per_block,
            Priority.LOW: swap_out_chunk_blocks * pages_per_block,
        }
        self._jobs: dict[int, _Job] = {}
        self._job_of: dict[int, int] = {}  # transfer id -> job id
        self._done: list[JobDone] = []
        self._next_transfer_id = 0
        self.counts = TransferCounts()

    @property
    def num_pending_jobs(self) -> int:
        return len(self._jobs)

    def submit_load(self, job_id: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Host -> device: `pairs` are (device slot, host slot)."""
        self._submit(job_id, [(host, device) for device, host in pairs], Direction.CPU_TO_GPU)

    def submit_store(self, job_id: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Device -> host: `pairs` are (device slot, host slot)."""
        self._submit(job_id, pairs, Direction.GPU_TO_CPU)

    def finished(self) -> list[JobDone]:
        """Jobs finished since the last call (never blocks)."""
        self._collect(self.engine.poll())
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs finished; their results come with `finished()`."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue  # finished already, or never ours
            self._collect([self.engine.wait(tid) for tid in sorted(job.pending)])

    def _submit(self, job_id: int, pairs: Sequence[tuple[int, int]], direction: Direction) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        priority = Priority.HIGH if direction is Direction.CPU_TO_GPU else Priority.LOW
        size = self._chunk_pages[priority]
        chunks = []
        for start in range(0, len(pairs), size):
            part = pairs[start : start + size]
            chunks.append(
                TransferChunk(
                    transfer_id=self._next_transfer_id,
                    direction=direction,
                    priority=priority,
                    src_slots=tuple(src for src, _ in part),
                    dst_slots=tuple(dst for _, dst in part),
                    num_bytes=len(part) * self.page_bytes,
                )
            )
            self._next_transfer_id += 1
        if not chunks:  # nothing to move (vLLM may send an empty job): done at once
            self._done.append(JobDone(job_id, True, 0, 0.0))
            return
        self._jobs[job_id] = _Job(
            pending={chunk.transfer_id for chunk in chunks},
            is_load=direction is Direction.CPU_TO_GPU,
        )
        for chunk in chunks:
            self._job_of[chunk.transfer_id] = job_id
            self.engine.submit(chunk)

    def _collect(self, results: Iterable[TransferResult]) -> None:
        for result in results:
            job_id = self._job_of.pop(result.transfer_id)
            job = self._jobs[job_id]
            job.pending.discard(result.transfer_id)
            job.num_bytes += result.num_bytes
            job.success = job.success and result.success
            job.start_s = (
                result.start_s if job.start_s is None else min(job.start_s, result.start_s)
            )
            job.end_s = max(job.end_s, result.end_s)
            if result.error is not None:
                job.errors.append(result.error)
            if not job.pending:
                del self._jobs[job_id]
                self._count(job)
                error = job.errors[0] if job.errors else None
                self._done.append(
                    JobDone(job_id, job.success, job.num_bytes, job.end_s - job.start_s, error)
                )

    def _count(self, job: _Job) -> None:
        counts = self.counts
        if not job.success:
            self.counts = replace(counts, num_failed=counts.num_failed + 1)
        elif job.is_load:
            self.counts = replace(
                counts,
                num_loads=counts.num_loads + 1,
                loaded_bytes=counts.loaded_bytes + job.num_bytes,
            )
        else:
            self.counts = replace(
                counts,
                num_stores=counts.num_stores + 1,
                stored_bytes=counts.stored_bytes + job.num_bytes,
            )
