"""GPU eviction on demand: the synchronous fallback, preemption, and CPU slots.

Swap-out ahead of need (past the high watermark, LOW queue) is the demoter's
GPU -> CPU pass (demotion.py). When the GPU is full and nothing can leave in
time, `ensure_gpu_slots` evicts now and waits for a swap-out: a counted
`sync_stall`, never a crash or an overwrite. Every victim meets the demoter's
one rule (`Demoter.move_down`): clean blocks (a ready copy below) are dropped
for free; dirty ones are copied down and freed on completion (the mover does
that).
"""

from __future__ import annotations

from collections.abc import Callable

from kvswap.base.tier import CPU_TIER, GPU_TIER
from kvswap.base.transfer import Direction, Priority
from kvswap.control.blocks import Block, Copy
from kvswap.control.demotion import Demoter
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.room import make_room
from kvswap.control.store import BlockStore


class Evictor:
    def __init__(
        self,
        store: BlockStore,
        mover: Mover,
        metrics: KVMetrics,
        demoter: Demoter,
        clock_s: Callable[[], float],
    ):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.demoter = demoter
        self._to_cpu = demoter.pair_below[GPU_TIER]
        self._clock_s = clock_s

    def ensure_gpu_slots(self, num_blocks: int) -> bool:
        """Make `num_blocks` GPU slots free now, evicting synchronously if needed."""
        gpu = self.store.tiers[GPU_TIER]
        if gpu.num_free_slots >= num_blocks:
            return True
        victims: list[Block] = []
        expected_free = gpu.num_free_slots + self.mover.num_gpu_evictions_pending
        with self.store.victims(GPU_TIER) as ranked:
            while expected_free < num_blocks:
                victim = ranked.next()
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

    def evict(
        self, victims: list[Block], *, reason: str, priority: Priority = Priority.LOW
    ) -> None:
        """Drop clean GPU copies now; copy dirty ones down and free them on completion."""
        self.demoter.move_down(self._to_cpu, victims, reason=reason, priority=priority)

    @staticmethod
    def evictable_now(block: Block) -> bool:
        gpu = block.copies.get(GPU_TIER)
        return gpu is not None and not gpu.is_busy and block.num_running_refs == 0

    def cpu_slot(self, block: Block) -> Copy | None:
        """A CPU copy for `block` (`make_room`): an unreferenced cache entry is
        discarded only to save a referenced block, never to make room for another
        cache entry (the GPU victim's own discard is as good)."""
        return make_room(self.store, self.metrics, CPU_TIER, block, displace_cache=False)
