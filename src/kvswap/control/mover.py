"""Submitting chunks and applying their completions to the store.

The mover is the only code that turns a decision ("copy these blocks down")
into `TransferChunk`s and, when results come back, into copy state:

    plan:     source copy  num_readers += 1      destination copy  ready = False
              (`reserve`; `unreserve` gives a source back that was not used)
    submit:   the chunk goes to the copy engine
    complete: source copy  num_readers -= 1      destination copy  ready = True
              (or dropped: failure, stale source, stale destination)
              eviction: the source copy is freed once its bytes are safe below

A slot is therefore never reused while a transfer reads or writes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.store import BlockStore
from kvswap.control.transfer import (
    CopyEngine,
    Direction,
    Priority,
    Tier,
    TransferChunk,
    TransferResult,
)


@dataclass
class _InFlight:
    chunk: TransferChunk
    blocks: list[Block]
    evict: bool  # free the source copy once the destination is ready


class Mover:
    def __init__(
        self,
        store: BlockStore,
        engine: CopyEngine,
        metrics: KVMetrics,
        block_bytes: int,
        on_arrival: Callable[[Block, Tier], None],
        *,
        swap_in_chunk_blocks: int,
        swap_out_chunk_blocks: int,
    ):
        self.store = store
        self.swap_in_chunk_blocks = swap_in_chunk_blocks
        self.swap_out_chunk_blocks = swap_out_chunk_blocks
        self.engine = engine
        self.metrics = metrics
        self.block_bytes = block_bytes
        self._on_arrival = on_arrival
        self._ids = itertools.count(1)
        self.inflight: dict[int, _InFlight] = {}
        # (block id, destination tier) -> the transfer writing that copy (for waits)
        self.writing: dict[tuple[int, Tier], int] = {}
        self.num_gpu_evictions_pending = 0

    def reserve(self, block: Block, src_tier: Tier, dst: Copy) -> tuple[Block, Copy]:
        """Mark `block`'s `src_tier` copy as read by a planned transfer at once, so
        nothing done before the chunk is submitted can drop it."""
        block.copies[src_tier].num_readers += 1
        self.store.rerank(block)
        return block, dst

    def unreserve(self, block: Block, src_tier: Tier) -> None:
        """Give back a source reserved for a transfer that will not be submitted."""
        block.copies[src_tier].num_readers -= 1
        self.store.rerank(block)

    @property
    def has_inflight(self) -> bool:
        return bool(self.inflight)

    def chunk_blocks(self, direction: Direction, priority: Priority) -> int:
        """Swap-in and prefetch (up the hierarchy, HIGH) move in swap-in chunks;
        everything else in swap-out chunks."""
        upward = direction in (Direction.CPU_TO_GPU, Direction.NVME_TO_CPU)
        if priority is Priority.HIGH and upward:
            return self.swap_in_chunk_blocks
        return self.swap_out_chunk_blocks

    def submit(
        self,
        direction: Direction,
        priority: Priority,
        pairs: Sequence[tuple[Block, Copy]],
        *,
        evict: bool,
    ) -> list[int]:
        """Copy each block's `direction.src_tier` copy into the given destination copy,
        in chunks of at most `chunk_blocks(direction, priority)`. Returns the transfer
        ids. Sources are already reserved (`reserve`) when they were planned."""
        chunk_blocks = self.chunk_blocks(direction, priority)
        ids: list[int] = []
        for start in range(0, len(pairs), chunk_blocks):
            part = pairs[start : start + chunk_blocks]
            src_slots = []
            for block, _ in part:
                src = block.copies[direction.src_tier]
                assert src.num_readers > 0, "the swapper reserves a source when it plans it"
                src_slots.append(src.slot)
            transfer_id = next(self._ids)
            chunk = TransferChunk(
                transfer_id=transfer_id,
                direction=direction,
                priority=priority,
                src_slots=tuple(src_slots),
                dst_slots=tuple(dst.slot for _, dst in part),
                num_bytes=len(part) * self.block_bytes,
            )
            blocks = [block for block, _ in part]
            self.inflight[transfer_id] = _InFlight(chunk, blocks, evict)
            for block in blocks:
                self.writing[(block.block_id, direction.dst_tier)] = transfer_id
            if evict and direction.src_tier is Tier.GPU:
                self.num_gpu_evictions_pending += len(blocks)
            self.engine.submit(chunk)
            ids.append(transfer_id)
        return ids

    def poll(self) -> None:
        for result in self.engine.poll():
            self.complete(result)

    def wait(self, transfer_id: int) -> None:
        if transfer_id in self.inflight:
            self.complete(self.engine.wait(transfer_id))

    def wait_all(self) -> None:
        for result in self.engine.wait_all():
            self.complete(result)

    def complete(self, result: TransferResult) -> None:
        record = self.inflight.pop(result.transfer_id)
        chunk = record.chunk
        direction = chunk.direction
        self.metrics.record_transfer(direction, result.num_bytes, result.duration_s)
        if not result.success:
            self.metrics.failed_transfers += 1
        failed = set(result.failed_dst_slots)
        for block in record.blocks:
            key = (block.block_id, direction.dst_tier)
            if self.writing.get(key) == chunk.transfer_id:
                del self.writing[key]
            if record.evict and direction.src_tier is Tier.GPU:
                self.num_gpu_evictions_pending -= 1
            self._finish_block(block, direction, record.evict, result.success, failed)

    def _finish_block(
        self, block: Block, direction: Direction, evict: bool, success: bool, failed: set[int]
    ) -> None:
        src_tier, dst_tier = direction.src_tier, direction.dst_tier
        src = block.copies[src_tier]
        dst = block.copies[dst_tier]
        src.num_readers -= 1
        ok = success and dst.slot not in failed and not src.stale and not dst.stale
        if ok:
            dst.ready = True
        else:
            self.store.drop_copy(block, dst_tier)
            if src_tier is Tier.NVME and (not success or dst.slot in failed):
                # A failed or corrupt NVMe read: that copy cannot be trusted again.
                src.stale = True
        if src.stale and src.num_readers == 0:
            was_lost = block.lost
            self.store.drop_copy(block, src_tier)
            if block.lost and not was_lost:
                self.metrics.lost_blocks += 1
        elif ok and evict and src.num_readers == 0 and self._may_evict(block, src_tier):
            self.store.drop_copy(block, src_tier)
        else:
            self.store.rerank(block)
        if ok and block.block_id in self.store.blocks:
            self._on_arrival(block, dst_tier)

    @staticmethod
    def _may_evict(block: Block, tier: Tier) -> bool:
        """An eviction is called off when the block became needed on the GPU meanwhile."""
        return not (tier is Tier.GPU and block.num_running_refs > 0)
