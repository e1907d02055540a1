"""Submitting chunks and applying their completions to the store.

The mover is the only code that turns a decision ("copy these blocks down")
into `TransferChunk`s and, when results come back, into copy state:

    plan:     the source copy is reserved (`reserve`: `store.reserve_source`);
              the destination copy was placed being written (`store.place`)
              (`unreserve` gives a source back that was not used)
    submit:   the chunk goes to the copy engine
    complete: `store.finish_transfer` per block: the destination copy is ready
              (or dropped: failure, stale source, stale destination); with
              eviction the source copy is freed once its bytes are safe below

The mover changes no copy itself: the store owns copy state and tells the
policies. A slot is never reused while a transfer reads or writes it.

A chunk to or from a tier addressed by key (`Direction.keyed`) names its
blocks by key; that side's slots are the positions 0..n-1. A failed or corrupt
read from a tier with checked reads (NVMe, the remote store) marks that source
copy stale: it is never read again, and a block left with no copy is lost (its
owner recomputes it).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.base.tier import GPU_TIER, Tier
from kvswap.base.transfer import (
    HIGH_PRIORITY,
    CopyEngine,
    Direction,
    Priority,
    TransferChunk,
    TransferResult,
)
from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.store import BlockStore

#: Called with each chunk and its blocks as it is submitted (a read-only look: the
#: simulator counts swap-ins per block through it).
SubmitHook = Callable[[TransferChunk, Sequence[Block]], None]


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
        on_arrival: Callable[[Block, Tier, Tier], None],
        *,
        swap_in_chunk_blocks: int,
        swap_out_chunk_blocks: int,
        on_submit: SubmitHook | None = None,
    ):
        self.store = store
        self._on_submit = on_submit
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
        self.store.reserve_source(block, src_tier)
        return block, dst

    def unreserve(self, block: Block, src_tier: Tier) -> None:
        """Give back a source reserved for a transfer that will not be submitted."""
        self.store.release_source(block, src_tier)

    @property
    def has_inflight(self) -> bool:
        return bool(self.inflight)

    def chunk_blocks(self, direction: Direction, priority: Priority) -> int:
        """Swap-in and prefetch (up the hierarchy, HIGH) move in swap-in chunks;
        everything else in swap-out chunks."""
        if priority is HIGH_PRIORITY and direction.upward:
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
        remote = direction.keyed
        src_tier, dst_tier = direction.src_tier, direction.dst_tier  # properties: read once
        writing = self.writing
        ids: list[int] = []
        for start in range(0, len(pairs), chunk_blocks):
            part = pairs[start : start + chunk_blocks]
            transfer_id = next(self._ids)
            blocks: list[Block] = []
            src_slots: list[int] = []
            dst_slots: list[int] = []
            # One pass per chunk (no comprehension per list): a side addressed by key
            # has no slots, its slots are the positions.
            for position, (block, dst) in enumerate(part):
                src = block.copies[src_tier]
                assert src.num_readers > 0, "the swapper reserves a source when it plans it"
                blocks.append(block)
                src_slots.append(position if src.slot is None else src.slot)
                dst_slots.append(position if dst.slot is None else dst.slot)
                writing[(block.block_id, dst_tier)] = transfer_id
            keys = tuple(_key(block) for block in blocks) if remote else ()
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
            if evict and src_tier is GPU_TIER:
                self.num_gpu_evictions_pending += len(blocks)
            self.num_inflight_by_direction[direction] += 1
            if self._on_submit is not None:
                self._on_submit(chunk, blocks)
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
        keyed_write = direction.keyed and not direction.upward
        if keyed_write:
            # Only the blocks the store took count as bytes to it: a write skipped
            # (never sent) or refused moved nothing there. (A local read that failed
            # its CRC did read its bytes; those directions count the chunk.)
            num_stored = 0 if not result.success else sum(s not in failed for s in chunk.dst_slots)
            num_bytes = num_stored * self.block_bytes
        self.metrics.record_transfer(direction, num_bytes, result.duration_s)
        if not result.success and not keyed_write:
            # A write the store failed or skipped loses nothing: it is counted as such.
            self.metrics.failed_transfers += 1
        num_ok = num_bad = 0
        # Read once per chunk, not per block: properties and attributes of the chunk.
        src_tier, dst_tier = direction.src_tier, direction.dst_tier
        evict, success, transfer_id = record.evict, result.success, chunk.transfer_id
        gpu_eviction = evict and src_tier is GPU_TIER
        writing, finish, metrics = self.writing, self.store.finish_transfer, self.metrics
        for block, dst_slot in zip(record.blocks, chunk.dst_slots, strict=True):
            key = (block.block_id, dst_tier)
            if writing.get(key) == transfer_id:
                del writing[key]
            if gpu_eviction:
                self.num_gpu_evictions_pending -= 1
            bad = not success or dst_slot in failed
            num_bad += bad
            # Each block's completion in full (and its arrival) before the next one's.
            outcome = finish(block, src_tier, dst_tier, intact=not bad, evict=evict)
            metrics.lost_blocks += outcome.lost_now
            if outcome.arrived:
                self._on_arrival(block, dst_tier, src_tier)
            num_ok += outcome.ready
        if not direction.keyed or (dst_tier if keyed_write else src_tier).local:
            return  # the remote figures are the shared tiers' (the slab's: its counters)
        if keyed_write:
            self.metrics.remote_writes += num_ok
            self.metrics.remote_write_failures += num_bad
        else:
            self.metrics.remote_fetch_failures += num_bad


def _key(block: Block) -> bytes:
    assert block.key is not None, f"block {block.block_id} moves to or from the store unkeyed"
    return block.key
