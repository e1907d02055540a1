"""CPU -> NVMe (and remote) demotion: the pinned pool's own watermarks.

A full pinned pool is the normal state; when it passes
`cpu_demote_high_watermark` the coldest CPU copies leave (LOW queue) until it
is back under `cpu_demote_low_watermark`. A CPU copy that already has a ready
copy below (NVMe or remote) is dropped for free; the others move to NVMe.
A full NVMe tier makes room as the pinned pool does (`eviction.make_room`):
its policy's least valuable droppable copies leave (dropped, or the cache
entry discarded: `nvme_drop`, `nvme_discard`), so the newest finished
conversations reach NVMe and the oldest leave it; the only copy of a
referenced block (a paused sequence's) never does.

With a remote tier written `on_demote`, every block the pool lets go is
written to the store first (unless the store has it): alongside its NVMe
demotion, or instead of a free drop (the CPU copy then goes once the write
succeeded). Without an NVMe tier the store is where cold blocks go: written,
then dropped from the pool.
"""

from __future__ import annotations

from kvswap.control.blocks import Block, Copy
from kvswap.control.eviction import make_room
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.remote_tier import RemoteTier
from kvswap.control.settings import SwapSettings
from kvswap.control.store import BlockStore
from kvswap.control.transfer import Direction, Priority, Tier


class Demoter:
    def __init__(
        self,
        store: BlockStore,
        mover: Mover,
        metrics: KVMetrics,
        settings: SwapSettings,
        remote: RemoteTier | None = None,
    ):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.settings = settings
        self.remote = remote

    def demote_past_watermark(self) -> None:
        cpu = self.store.tiers[Tier.CPU]
        nvme = self.store.tiers[Tier.NVME]
        remote = self.remote if self.remote is not None and self.remote.demotes else None
        if cpu.num_slots == 0 or (nvme.num_slots == 0 and remote is None):
            return
        if cpu.num_used_slots < self.settings.cpu_demote_high_watermark * cpu.num_slots:
            return
        target = self.settings.cpu_demote_low_watermark * cpu.num_slots
        used = cpu.num_used_slots
        room_remote = remote.write_room_blocks() if remote is not None else 0
        to_nvme: list[tuple[Block, Copy]] = []
        to_remote: list[tuple[Block, Copy]] = []
        skipped: list[Block] = []
        while used > target:
            victim = self.store.pop_victim(Tier.CPU)
            if victim is None:
                break
            write = None
            if remote is not None and room_remote > 0:
                write = remote.plan_write(victim)
                room_remote -= write is not None
            if write is not None:
                to_remote.append(write)
                self.metrics.evictions_by_reason["demote_remote"] += 1
            if victim.has_ready_copy_below(Tier.CPU):
                if write is None:  # else the CPU copy goes once the write succeeded
                    self.store.drop_copy(victim, Tier.CPU)
                    self.metrics.evictions_by_reason["demote_drop"] += 1
            elif Tier.NVME in victim.copies or nvme.num_slots == 0:
                if write is None:
                    # An older NVMe copy still being written, or no NVMe tier and no
                    # room for a remote write now: the block stays for a later pass.
                    skipped.append(victim)
                    continue
            else:
                nvme_copy = make_room(
                    self.store, self.metrics, Tier.NVME, victim, displace_cache=True
                )
                if nvme_copy is None:
                    skipped.append(victim)
                    break
                to_nvme.append(self.mover.reserve(victim, Tier.CPU, nvme_copy))
                self.metrics.evictions_by_reason["demote"] += 1
            used -= 1
        for block in skipped:
            self.store.return_victim(Tier.CPU, block)
        # Both with evict: the CPU copy is freed by whichever completes last, successfully.
        self.mover.submit(Direction.CPU_TO_NVME, Priority.LOW, to_nvme, evict=True)
        if remote is not None:
            remote.submit_writes(to_remote, evict=True)
