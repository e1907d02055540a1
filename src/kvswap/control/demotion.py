"""CPU -> NVMe demotion: the pinned pool's own watermarks.

A full pinned pool is the normal state; when it passes
`cpu_demote_high_watermark` the coldest CPU copies move down to NVMe (LOW
queue) until it is back under `cpu_demote_low_watermark`. A CPU copy that
already has a ready NVMe copy is dropped for free.
"""

from __future__ import annotations

from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.settings import SwapSettings
from kvswap.control.store import BlockStore
from kvswap.control.transfer import Direction, Priority, Tier


class Demoter:
    def __init__(self, store: BlockStore, mover: Mover, metrics: KVMetrics, settings: SwapSettings):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.settings = settings

    def demote_past_watermark(self) -> None:
        cpu = self.store.tiers[Tier.CPU]
        nvme = self.store.tiers[Tier.NVME]
        if cpu.num_slots == 0 or nvme.num_slots == 0:
            return
        if cpu.num_used_slots < self.settings.cpu_demote_high_watermark * cpu.num_slots:
            return
        target = self.settings.cpu_demote_low_watermark * cpu.num_slots
        used = cpu.num_used_slots
        pairs: list[tuple[Block, Copy]] = []
        skipped: list[Block] = []
        while used > target:
            victim = self.store.cpu_policy.pop_victim()
            if victim is None:
                break
            if victim.ready_copy(Tier.NVME) is not None:
                self.store.drop_copy(victim, Tier.CPU)
                self.metrics.evictions_by_reason["demote_drop"] += 1
            elif Tier.NVME in victim.copies:
                skipped.append(victim)  # an older NVMe copy is still being written
                continue
            else:
                nvme_copy = self.store.place(victim, Tier.NVME, ready=False)
                if nvme_copy is None:
                    skipped.append(victim)
                    break
                pairs.append(self.mover.reserve(victim, Tier.CPU, nvme_copy))
                self.metrics.evictions_by_reason["demote"] += 1
            used -= 1
        for block in skipped:
            self.store.rerank(block)
        self.mover.submit(Direction.CPU_TO_NVME, Priority.LOW, pairs, evict=True)
