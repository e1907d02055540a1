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

A remote chunk (`REMOTE_DIRECTIONS`) names its blocks by key; its remote side's
slots are the positions 0..n-1. A failed or corrupt read from NVMe or from the
remote store marks that source copy stale: it is never read again, and a
block left with no copy is lost (its owner recomputes it).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.store import BlockStore
from kvswap.control.transfer import (
    REMOTE_DIRECTIONS,
    CopyEngine,
    Direction,
    Priority,
    Tier,
    TransferChunk,
    TransferResult,
)

#: Directions up the hierarchy: on HIGH they move in swap-in chunks.
_UPWARD = frozenset({Direction.CPU_TO_GPU, Direction.NVME_TO_CPU, Direction.REMOTE_TO_CPU})
#: Sources whose failed read means the copy itself is bad (a CRC or value check failed,
#: the key vanished), not only this transfer.
_CHECKED_SOURCES = frozenset({Tier.NVME, Tier.REMOTE})


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
        self.num_inflight_by_direction: Counter[Direction] = Counter()

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
        if priority is Priority.HIGH and direction in _UPWARD:
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
        remote = direction in REMOTE_DIRECTIONS
        ids: list[int] = []
        for start in range(0, len(pairs), chunk_blocks):
            part = pairs[start : start + chunk_blocks]
            src_slots = []
            for block, _ in part:
                src = block.copies[direction.src_tier]
                assert src.num_readers > 0, "the swapper reserves a source when it plans it"
                src_slots.append(src.slot)
            dst_slots = [dst.slot for _, dst in part]
            blocks = [block for block, _ in part]
            keys: tuple[bytes, ...] = ()
            if remote:
                # The remote side is addressed by key; its slots are the positions.
                positions = list(range(len(part)))
                if direction.src_tier is Tier.REMOTE:
                    src_slots = positions
                else:
                    dst_slots = positions
                keys = tuple(_key(block) for block in blocks)
            transfer_id = next(self._ids)
            chunk = TransferChunk(
                transfer_id=transfer_id,
                direction=direction,
                priority=priority,
                src_slots=tuple(src_slots),
                dst_slots=tuple(dst_slots),
                num_bytes=len(part) * self.block_bytes,
                keys=keys,
            )
            self.inflight[transfer_id] = _InFlight(chunk, blocks, evict)
            for block in blocks:
                self.writing[(block.block_id, direction.dst_tier)] = transfer_id
            if evict and direction.src_tier is Tier.GPU:
                self.num_gpu_evictions_pending += len(blocks)
            self.num_inflight_by_direction[direction] += 1
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
        self.num_inflight_by_direction[direction] -= 1
        failed = set(result.failed_dst_slots)
        num_bytes = result.num_bytes
        if direction is Direction.CPU_TO_REMOTE:
            # Only the blocks the store took count as bytes to it: a write skipped
            # (never sent) or refused moved nothing there. (A local read that failed
            # its CRC did read its bytes; those directions count the chunk.)
            num_stored = 0 if not result.success else sum(s not in failed for s in chunk.dst_slots)
            num_bytes = num_stored * self.block_bytes
        self.metrics.record_transfer(direction, num_bytes, result.duration_s)
        if not result.success and direction is not Direction.CPU_TO_REMOTE:
            # A write the store failed or skipped loses nothing: it is counted as such.
            self.metrics.failed_transfers += 1
        num_ok = num_bad = 0
        for block, dst_slot in zip(record.blocks, chunk.dst_slots, strict=True):
            key = (block.block_id, direction.dst_tier)
            if self.writing.get(key) == chunk.transfer_id:
                del self.writing[key]
            if record.evict and direction.src_tier is Tier.GPU:
                self.num_gpu_evictions_pending -= 1
            bad = not result.success or dst_slot in failed
            num_bad += bad
            num_ok += self._finish_block(block, direction, record.evict, bad)
        if direction is Direction.CPU_TO_REMOTE:
            self.metrics.remote_writes += num_ok
            self.metrics.remote_write_failures += num_bad
        elif direction is Direction.REMOTE_TO_CPU:
            self.metrics.remote_fetch_failures += num_bad

    def _finish_block(self, block: Block, direction: Direction, evict: bool, bad: bool) -> bool:
        """Apply one block's completion (`bad`: its bytes did not arrive intact);
        True when its destination copy is ready."""
        src_tier, dst_tier = direction.src_tier, direction.dst_tier
        src = block.copies[src_tier]
        dst = block.copies[dst_tier]
        src.num_readers -= 1
        ok = not bad and not src.stale and not dst.stale
        if ok:
            dst.ready = True
        else:
            if src_tier in _CHECKED_SOURCES and bad:
                # A failed or corrupt NVMe or remote read: that copy cannot be trusted again.
                src.stale = True
            # May forget the block (nobody references it, only a remote copy is left).
            self.store.drop_copy(block, dst_tier)
        if block.copies.get(src_tier) is not src:
            pass  # the block was forgotten with its source copy
        elif src.stale and src.num_readers == 0:
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
        return ok

    @staticmethod
    def _may_evict(block: Block, tier: Tier) -> bool:
        """An eviction is called off when the block became needed on the GPU meanwhile."""
        return not (tier is Tier.GPU and block.num_running_refs > 0)


def _key(block: Block) -> bytes:
    assert block.key is not None, f"block {block.block_id} moves to or from the store unkeyed"
    return block.key
