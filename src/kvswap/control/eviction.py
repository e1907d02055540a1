"""GPU eviction: the watermarks, the synchronous fallback, and CPU slots for what leaves.

Swap-out is the cheap direction (nobody waits for it), so it runs ahead of
need: past the high watermark, from the policy's coldest candidates down to
the low watermark, on the LOW queue. When the GPU is full and nothing can
leave in time, `ensure_gpu_slots` waits for a swap-out: a counted
`sync_stall`, never a crash or an overwrite. Clean blocks (a ready copy
below) are dropped for free; dirty ones are copied down and freed on
completion (the mover does that).
"""

from __future__ import annotations

from collections.abc import Callable

from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.settings import SwapSettings
from kvswap.control.store import BlockStore
from kvswap.control.transfer import Direction, Priority, Tier


class Evictor:
    def __init__(
        self,
        store: BlockStore,
        mover: Mover,
        metrics: KVMetrics,
        settings: SwapSettings,
        clock_s: Callable[[], float],
    ):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.settings = settings
        self._clock_s = clock_s

    def ensure_gpu_slots(self, num_blocks: int) -> bool:
        """Make `num_blocks` GPU slots free now, evicting synchronously if needed."""
        gpu = self.store.tiers[Tier.GPU]
        if gpu.num_free_slots >= num_blocks:
            return True
        victims: list[Block] = []
        expected_free = gpu.num_free_slots + self.mover.num_gpu_evictions_pending
        while expected_free < num_blocks:
            victim = self.store.pop_victim(Tier.GPU)
            if victim is None:
                break
            victims.append(victim)
            expected_free += 1
        self.evict(victims, reason="sync", priority=Priority.HIGH)
        if gpu.num_free_slots < num_blocks and self.mover.num_gpu_evictions_pending:
            self.metrics.sync_stalls += 1
            start_s = self._clock_s()
            for transfer_id, record in list(self.mover.inflight.items()):
                if record.evict and record.chunk.direction is Direction.GPU_TO_CPU:
                    self.mover.wait(transfer_id)
                if gpu.num_free_slots >= num_blocks:
                    break
            self.metrics.swap_wait_s += self._clock_s() - start_s
        return gpu.num_free_slots >= num_blocks

    def swap_out_past_watermark(self) -> None:
        gpu = self.store.tiers[Tier.GPU]
        if gpu.num_slots == 0:
            return
        used = gpu.num_used_slots - self.mover.num_gpu_evictions_pending
        if used < self.settings.swap_out_high_watermark * gpu.num_slots:
            return
        target = self.settings.swap_out_low_watermark * gpu.num_slots
        victims: list[Block] = []
        while used > target:
            victim = self.store.pop_victim(Tier.GPU)
            if victim is None:
                break
            victims.append(victim)
            used -= 1
        self.evict(victims, reason="watermark")

    def evict(
        self, victims: list[Block], *, reason: str, priority: Priority = Priority.LOW
    ) -> None:
        """Drop clean GPU copies now; copy dirty ones down and free them on completion."""
        pairs: list[tuple[Block, Copy]] = []
        for block in victims:
            self.store.unrank(Tier.GPU, block)  # a victim not popped (preemption) too
            if block.has_ready_copy_below(Tier.GPU):
                self.store.drop_copy(block, Tier.GPU)
                self.metrics.evictions_by_reason[f"{reason}_drop"] += 1
                continue
            if Tier.CPU in block.copies:
                # A stale CPU copy still read by a demotion in flight: the block gets
                # no second CPU copy, and stays until that transfer ends.
                self.store.return_victim(Tier.GPU, block)
                continue
            cpu = self.cpu_slot(block)
            if cpu is not None:
                pairs.append(self.mover.reserve(block, Tier.GPU, cpu))
                self.metrics.evictions_by_reason[f"{reason}_swap_out"] += 1
            elif block.ref_count == 0:
                self.store.delete_block(block)  # an unreferenced cache entry with nowhere to go
                self.metrics.evictions_by_reason[f"{reason}_discard"] += 1
            else:
                self.store.return_victim(Tier.GPU, block)  # stays; nowhere below has room
        self.mover.submit(Direction.GPU_TO_CPU, priority, pairs, evict=True)

    @staticmethod
    def evictable_now(block: Block) -> bool:
        gpu = block.copies.get(Tier.GPU)
        return gpu is not None and not gpu.is_busy and block.num_running_refs == 0

    def cpu_slot(self, block: Block) -> Copy | None:
        """A CPU copy for `block` (`make_room`): an unreferenced cache entry is
        discarded only to save a referenced block, never to make room for another
        cache entry (the GPU victim's own discard is as good)."""
        return make_room(self.store, self.metrics, Tier.CPU, block, displace_cache=False)


def make_room(
    store: BlockStore, metrics: KVMetrics, tier: Tier, block: Block, *, displace_cache: bool
) -> Copy | None:
    """A copy of `block` placed on `tier` (CPU or NVMe) being written, or None.

    A lower tier full of KV is its normal state: when it has no free slot, its
    policy's cheapest droppable copies leave (`pop_victim(tier, droppable_only=True)`)
    until one is free. A copy with a ready copy further down, or of a block
    referenced elsewhere (a ready copy above), is dropped (`{tier}_drop`); an
    unreferenced block with nothing further down is discarded, every copy of it
    (`{tier}_discard`). The only copy of a referenced block never leaves, and
    nothing busy does. With `displace_cache` False an unreferenced `block` never
    displaces another unreferenced one (one cache entry for another is no gain);
    True (demotion: the newer block leaves the tier above either way) it does,
    least recently used first, but never a block of its own prefix.
    """
    copy = store.place(block, tier, ready=False)
    while copy is None:
        victim = store.pop_victim(tier, droppable_only=True)
        if victim is None:
            return None
        if not victim.has_ready_copy_below(tier) and victim.ref_count == 0:
            if block.ref_count == 0 and (not displace_cache or _is_prefix_of(victim, block)):
                # Stays: one cache entry for another is no gain; nor is a prefix's head
                # for its own tail (the tail is found only through the head).
                store.return_victim(tier, victim)
                return None
            store.delete_block(victim)
            metrics.evictions_by_reason[f"{tier.value}_discard"] += 1
        else:
            store.drop_copy(victim, tier)
            metrics.evictions_by_reason[f"{tier.value}_drop"] += 1
        copy = store.place(block, tier, ready=False)
    return copy


def _is_prefix_of(victim: Block, block: Block) -> bool:
    """Whether `victim` is one of the blocks `block`'s chain extends."""
    parent = block.parent
    while parent is not None:
        if parent is victim:
            return True
        parent = parent.parent
    return False
