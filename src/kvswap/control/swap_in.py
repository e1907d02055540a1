"""Swap-in: prefetch ahead of need, and the wait a step makes for what is missing.

Swap-in is the expensive direction (a decode step waits for it), so it runs
on the HIGH queue in `swap_in_chunk_blocks` chunks. A block on a keyed tier
(the NVMe slab, the store, ...) comes up in two hops: that tier -> CPU, then
CPU -> GPU as soon as it arrives (`arrived`); the fastest tier that holds it is
read (NVMe first).
Time spent in `wait_ready` is the step's swap wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvswap.base.tier import CPU_TIER, GPU_TIER, Tier, tier_rank
from kvswap.base.transfer import CPU_TO_GPU, HIGH_PRIORITY, direction_between
from kvswap.control.blocks import Block, Copy
from kvswap.control.eviction import Evictor
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.store import BlockStore


@dataclass(frozen=True)
class WaitResult:
    """What a `wait_ready` call did: the sequences that could not be made resident
    (no GPU room even after synchronous eviction) and how long it waited."""

    not_ready: tuple[int, ...]
    wait_s: float


class SwapIn:
    def __init__(
        self,
        store: BlockStore,
        mover: Mover,
        evictor: Evictor,
        metrics: KVMetrics,
        clock_s: Callable[[], float],
    ):
        self.store = store
        self.mover = mover
        self.evictor = evictor
        self.metrics = metrics
        self._clock_s = clock_s
        self._wanted_on_gpu: set[int] = set()  # block ids to bring up when they reach the CPU
        self._prefetched: set[int] = set()  # block ids swapped in ahead of a wait
        # Running sequences whose blocks were all ready on the GPU at a wait_ready.
        # That stays true until they pause or end: running blocks are never
        # eviction candidates, an eviction in flight is called off for them, and
        # their new blocks are allocated on the GPU. `check_integrity` verifies it.
        self.resident: set[int] = set()

    def forget(self, seq_id: int) -> None:
        """The sequence paused or ended: its residency must be checked again."""
        self.resident.discard(seq_id)

    def prefetch(self, seq_ids: Iterable[int]) -> None:
        """Start bringing these sequences' blocks to the GPU (HIGH queue), without waiting."""
        self._fetch(seq_ids, sync=False)

    def wait_ready(self, seq_ids: Sequence[int]) -> WaitResult:
        """Block until the blocks of `seq_ids` are on the GPU (the time counts as
        swap wait)."""
        start_s = self._clock_s()
        # Sequences found resident by an earlier call and running since need no
        # check (see `resident`): a step costs O(sequences), not O(their blocks).
        pending = [seq_id for seq_id in seq_ids if seq_id not in self.resident]
        for _ in range(3 * len(seq_ids) + 8):
            self.mover.poll()
            missing = [
                b for s in pending for b in self.store.sequence_blocks(s) if self._missing(b)
            ]
            if not missing:
                break
            self._fetch(pending, sync=True)
            waited = False
            for block in missing:
                for tier in (GPU_TIER, CPU_TIER):
                    transfer_id = self.mover.writing.get((block.block_id, tier))
                    if transfer_id is not None:
                        self.mover.wait(transfer_id)
                        waited = True
            if not waited and not self.mover.has_inflight:
                break  # nothing is moving: the rest cannot come up now
        not_ready: list[int] = []
        for seq_id in pending:
            blocks = self.store.sequence_blocks(seq_id)
            if any(self._missing(block) for block in blocks):
                not_ready.append(seq_id)
                continue
            for block in blocks:
                if block.block_id in self._prefetched:
                    self._prefetched.discard(block.block_id)
                    self.metrics.prefetch_hits += 1
            self.store.touch(blocks)
            # A lost block (its last copy failed) is not on the GPU: the owner truncates
            # the table there, and the next wait checks the sequence again.
            if self.store.sequences[seq_id].running and not any(b.lost for b in blocks):
                self.resident.add(seq_id)
        wait_s = self._clock_s() - start_s
        self.metrics.swap_wait_s += wait_s
        return WaitResult(tuple(not_ready), wait_s)

    def num_missing_gpu_blocks(self, seq_id: int) -> int:
        return sum(GPU_TIER not in b.copies for b in self.store.sequence_blocks(seq_id))

    @staticmethod
    def _missing(block: Block) -> bool:
        return not block.lost and block.ready_copy(GPU_TIER) is None

    def _fetch(self, seq_ids: Iterable[int], *, sync: bool) -> None:
        to_gpu: list[tuple[Block, Copy]] = []
        to_cpu: dict[Tier, list[tuple[Block, Copy]]] = {}
        for seq_id in seq_ids:
            for block in self.store.sequence_blocks(seq_id):
                if block.lost or GPU_TIER in block.copies:
                    continue
                cpu_copy = block.ready_copy(CPU_TIER)
                if cpu_copy is not None:
                    # Hold the source first: making GPU room may drop cold CPU copies.
                    self.mover.reserve(block, CPU_TIER, cpu_copy)
                    room = not sync or self.evictor.ensure_gpu_slots(1)
                    gpu = self.store.place(block, GPU_TIER, ready=False) if room else None
                    if gpu is None:
                        self.mover.unreserve(block, CPU_TIER)
                        continue
                    to_gpu.append((block, gpu))
                    self._note_fetch(block, sync)
                elif CPU_TIER not in block.copies and (source := _below_cpu(block)) is not None:
                    cpu = self.evictor.cpu_slot(block)
                    if cpu is not None:
                        pair = self.mover.reserve(block, source, cpu)
                        to_cpu.setdefault(source, []).append(pair)
                        self._wanted_on_gpu.add(block.block_id)
                        self._note_fetch(block, sync)
                elif CPU_TIER in block.copies:
                    self._wanted_on_gpu.add(block.block_id)  # on its way up to the CPU
        self.mover.submit(CPU_TO_GPU, HIGH_PRIORITY, to_gpu, evict=False)
        for source in sorted(to_cpu, key=tier_rank):  # the fastest tier's chunks first
            direction = direction_between(source, CPU_TIER)
            self.mover.submit(direction, HIGH_PRIORITY, to_cpu[source], evict=False)

    def _note_fetch(self, block: Block, sync: bool) -> None:
        if sync:
            self.metrics.prefetch_misses += 1
            self._prefetched.discard(block.block_id)
        else:
            self._prefetched.add(block.block_id)

    def arrived(self, block: Block, tier: Tier) -> None:
        """A copy of `block` became ready on `tier` (called by the mover)."""
        if tier is GPU_TIER:
            self.store.swapped_in(block)
        elif tier is CPU_TIER and block.block_id in self._wanted_on_gpu:
            self._wanted_on_gpu.discard(block.block_id)
            gpu = self.store.place(block, GPU_TIER, ready=False)
            if gpu is not None:
                pair = self.mover.reserve(block, CPU_TIER, gpu)
                self.mover.submit(CPU_TO_GPU, HIGH_PRIORITY, [pair], evict=False)


def _below_cpu(block: Block) -> Tier | None:
    """The tier to bring `block` up from when it has no CPU copy: the fastest below
    the pinned pool with a ready copy (NVMe, local, first)."""
    fastest: Tier | None = None
    for tier, copy in block.copies.items():
        if (
            tier.rank > CPU_TIER.rank
            and copy.ready
            and not copy.stale
            and (fastest is None or tier.rank < fastest.rank)
        ):
            fastest = tier
    return fastest
