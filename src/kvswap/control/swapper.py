"""The swapper: watermarks, swap-in ahead of need, demotion, and the sync fallback.

Called by the scheduler (engine or simulator), once per step, in this order:

    begin_step(step)          apply finished transfers; age residency windows
    open_sequence / allocate  admit work; allocation may evict synchronously
    prefetch(seq_ids)         swap-in for sequences about to run (HIGH queue)
    wait_ready(seq_ids)       block until they are on the GPU (swap-wait time)
    ... the model runs ...
    end_step()                swap out past the high watermark (LOW queue),
                              demote cold CPU copies to NVMe

Swap-in is the expensive direction: it is planned before swap-out, runs on the
high-priority queue and is what a step waits for. Swap-out runs ahead of need,
from the high watermark down to the low one, in `swap_out_chunk_blocks` chunks.
When the GPU is full and nothing can leave in time, the step waits for a
swap-out: a `sync_stall`, counted, never a crash or an overwrite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvswap.config import KvSwapConfig
from kvswap.control.blocks import Block, Copy
from kvswap.control.mover import Mover
from kvswap.control.policy import PolicyOptions
from kvswap.control.store import BlockStore, StoreLayout
from kvswap.control.transfer import CopyEngine, Direction, Priority, Tier
from kvswap.control.metrics import KVMetrics


@dataclass(frozen=True)
class SwapSettings:
    block_bytes: int
    high_watermark: float = 0.85
    low_watermark: float = 0.65
    swap_out_chunk_blocks: int = 8
    swap_in_chunk_blocks: int = 4
    cpu_demote_high_watermark: float = 0.90
    cpu_demote_low_watermark: float = 0.80

    @classmethod
    def from_config(cls, config: KvSwapConfig, block_bytes: int) -> SwapSettings:
        swap = config.swap
        return cls(
            block_bytes=block_bytes,
            high_watermark=swap.swap_out_high_watermark,
            low_watermark=swap.swap_in_low_watermark,
            swap_out_chunk_blocks=swap.swap_out_chunk_blocks,
            swap_in_chunk_blocks=swap.swap_in_chunk_blocks,
            cpu_demote_high_watermark=swap.cpu_demote_high_watermark,
            cpu_demote_low_watermark=swap.cpu_demote_low_watermark,
        )


class Swapper:
    def __init__(
        self,
        layout: StoreLayout,
        options: PolicyOptions,
        settings: SwapSettings,
        engine: CopyEngine,
        clock_s: Callable[[], float],
        metrics: KVMetrics | None = None,
    ):
        self.settings = settings
        self.options = options
        self.store = BlockStore(layout, options)
        self.metrics = metrics if metrics is not None else KVMetrics()
        self.mover = Mover(self.store, engine, self.metrics, settings.block_bytes, self._arrived)
        self._clock_s = clock_s
        self._wanted_on_gpu: set[int] = set()  # block ids to bring up when they reach the CPU
        self._prefetched: set[int] = set()  # block ids swapped in ahead of a wait
        self.last_wait_s = 0.0  # swap wait of the latest wait_ready call
        # Running sequences whose blocks were all ready on the GPU at a wait_ready.
        # That stays true until they pause or end: running blocks are never
        # eviction candidates, an eviction in flight is called off for them, and
        # their new blocks are allocated on the GPU. check_integrity verifies it.
        self._resident: set[int] = set()

    # ------------------------------------------------------------ step bracket

    def begin_step(self, step: int) -> None:
        self.store.gpu_policy.advance(step)
        self.mover.poll()

    def end_step(self) -> None:
        """The step's KV is computed: publish its full blocks, then swap out and demote."""
        self.store.publish_computed()
        self.mover.poll()
        self._swap_out_past_watermark()
        self._demote_past_watermark()
        for tier, slots in self.store.tiers.items():
            peak = self.metrics.peak_used_blocks_by_tier
            peak[tier] = max(peak[tier], slots.peak_used_slots)

    # ------------------------------------------------------------- sequences

    def open_sequence(self, seq_id: int, prompt_ids: Sequence[int]) -> int:
        """Start a sequence; returns how many prompt tokens its prefix hits cover."""
        hits = self.store.open_sequence(seq_id, prompt_ids)
        for block in hits:
            tier = next((t for t in Tier if block.ready_copy(t) is not None), Tier.GPU)
            self.metrics.prefix_hit_blocks_by_tier[tier] += 1
        return len(hits) * self.store.block_tokens

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> bool:
        """Append tokens, giving new blocks GPU slots; False (nothing changed) if no room."""
        needed = self.store.num_new_blocks_needed(seq_id, len(token_ids))
        if needed and not self.ensure_gpu_slots(needed):
            return False
        for block in self.store.append_tokens(seq_id, token_ids):
            copy = self.store.place(block, Tier.GPU, ready=True)
            assert copy is not None, "slots were reserved above"
        return True

    def set_running(self, seq_id: int, running: bool) -> None:
        self._resident.discard(seq_id)
        if not running and self.options.sink_protection:
            protected = self.store.sequence_blocks(seq_id)[: self.store.layout.protected_blocks]
            self.metrics.protected_block_saves += sum(Tier.GPU in b.copies for b in protected)
        self.store.set_running(seq_id, running)

    def release(self, seq_id: int) -> None:
        """End a sequence without offloading (recompute preemption): its full blocks
        stay only as prefix cache, wherever they are."""
        self._resident.discard(seq_id)
        self.store.close_sequence(seq_id)

    def finish(self, seq_id: int) -> None:
        """End a sequence and offload its reusable blocks at once (LOW queue)."""
        self._resident.discard(seq_id)
        released = self.store.close_sequence(seq_id)
        pairs = []
        for block in released:
            gpu = block.ready_copy(Tier.GPU)
            if gpu is None or block.has_ready_copy_below(Tier.GPU) or Tier.CPU in block.copies:
                continue
            cpu = self._cpu_slot(block)
            if cpu is None:
                break
            pairs.append(self._reserve(block, Tier.GPU, cpu))
        self._submit(Direction.GPU_TO_CPU, Priority.LOW, pairs, evict=False)

    def swap_out_sequence(self, seq_id: int) -> None:
        """Preempt by swapping: pause the sequence and move its unprotected GPU
        blocks down now (clean ones are dropped, dirty ones copied, LOW queue)."""
        self.set_running(seq_id, False)
        blocks = self.store.sequence_blocks(seq_id)[self.store.layout.protected_blocks :]
        self._evict([b for b in blocks if self._evictable_now(b)], reason="preempt")

    # --------------------------------------------------------------- swap-in

    def prefetch(self, seq_ids: Iterable[int]) -> None:
        """Start bringing these sequences' blocks to the GPU (HIGH queue), without waiting."""
        self._fetch(seq_ids, sync=False)

    def wait_ready(self, seq_ids: Sequence[int]) -> list[int]:
        """Block until the blocks of `seq_ids` are on the GPU (the time counts as
        swap wait). Returns the sequences that could not be made resident (no GPU
        room even after synchronous eviction); the caller pauses them again."""
        start_s = self._clock_s()
        # Sequences found resident by an earlier call and running since need no
        # check (see `_resident`): a step costs O(sequences), not O(their blocks).
        pending = [seq_id for seq_id in seq_ids if seq_id not in self._resident]
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
                for tier in (Tier.GPU, Tier.CPU):
                    transfer_id = self.mover.writing.get((block.block_id, tier))
                    if transfer_id is not None:
                        self.mover.wait(transfer_id)
                        waited = True
            if not waited and not self.mover.inflight:
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
            if self.store.sequences[seq_id].running:
                self._resident.add(seq_id)
        self.last_wait_s = self._clock_s() - start_s
        self.metrics.swap_wait_s += self.last_wait_s
        return not_ready

    def _missing(self, block: Block) -> bool:
        return not block.lost and block.ready_copy(Tier.GPU) is None

    def _fetch(self, seq_ids: Iterable[int], *, sync: bool) -> None:
        to_gpu: list[tuple[Block, Copy]] = []
        to_cpu: list[tuple[Block, Copy]] = []
        for seq_id in seq_ids:
            for block in self.store.sequence_blocks(seq_id):
                if block.lost or Tier.GPU in block.copies:
                    continue
                cpu_copy = block.ready_copy(Tier.CPU)
                if cpu_copy is not None:
                    # Hold the source first: making GPU room may drop cold CPU copies.
                    self._reserve(block, Tier.CPU, cpu_copy)
                    room = not sync or self.ensure_gpu_slots(1)
                    gpu = self.store.place(block, Tier.GPU, ready=False) if room else None
                    if gpu is None:
                        cpu_copy.num_readers -= 1
                        self.store.rerank(block)
                        continue
                    to_gpu.append((block, gpu))
                    self._note_fetch(block, sync)
                elif Tier.CPU not in block.copies and block.ready_copy(Tier.NVME) is not None:
                    cpu = self._cpu_slot(block)
                    if cpu is not None:
                        to_cpu.append(self._reserve(block, Tier.NVME, cpu))
                        self._wanted_on_gpu.add(block.block_id)
                        self._note_fetch(block, sync)
                elif Tier.CPU in block.copies:
                    self._wanted_on_gpu.add(block.block_id)  # on its way up to the CPU
        self._submit(Direction.CPU_TO_GPU, Priority.HIGH, to_gpu, evict=False)
        self._submit(Direction.NVME_TO_CPU, Priority.HIGH, to_cpu, evict=False)

    def _note_fetch(self, block: Block, sync: bool) -> None:
        if sync:
            self.metrics.prefetch_misses += 1
            self._prefetched.discard(block.block_id)
        else:
            self._prefetched.add(block.block_id)

    def _arrived(self, block: Block, tier: Tier) -> None:
        if tier is Tier.GPU:
            self.store.gpu_policy.on_swapped_in(block)
        elif tier is Tier.CPU and block.block_id in self._wanted_on_gpu:
            self._wanted_on_gpu.discard(block.block_id)
            gpu = self.store.place(block, Tier.GPU, ready=False)
            if gpu is not None:
                pair = self._reserve(block, Tier.CPU, gpu)
                self._submit(Direction.CPU_TO_GPU, Priority.HIGH, [pair], evict=False)

    # -------------------------------------------------------------- swap-out

    def ensure_gpu_slots(self, num_blocks: int) -> bool:
        """Make `num_blocks` GPU slots free now, evicting synchronously if needed."""
        gpu = self.store.tiers[Tier.GPU]
        if gpu.num_free_slots >= num_blocks:
            return True
        victims: list[Block] = []
        expected_free = gpu.num_free_slots + self.mover.num_gpu_evictions_pending
        while expected_free < num_blocks:
            victim = self.store.gpu_policy.pop_victim()
            if victim is None:
                break
            victims.append(victim)
            expected_free += 1
        self._evict(victims, reason="sync", priority=Priority.HIGH)
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

    def _swap_out_past_watermark(self) -> None:
        gpu = self.store.tiers[Tier.GPU]
        if gpu.num_slots == 0:
            return
        used = gpu.num_used_slots - self.mover.num_gpu_evictions_pending
        if used < self.settings.high_watermark * gpu.num_slots:
            return
        target = self.settings.low_watermark * gpu.num_slots
        victims: list[Block] = []
        while used > target:
            victim = self.store.gpu_policy.pop_victim()
            if victim is None:
                break
            victims.append(victim)
            used -= 1
        self._evict(victims, reason="watermark")

    def _evict(
        self, victims: list[Block], *, reason: str, priority: Priority = Priority.LOW
    ) -> None:
        """Drop clean GPU copies now; copy dirty ones down and free them on completion."""
        pairs: list[tuple[Block, Copy]] = []
        for block in victims:
            self.store.gpu_policy.forget(block)
            if block.has_ready_copy_below(Tier.GPU):
                self.store.drop_copy(block, Tier.GPU)
                self.metrics.evictions_by_reason[f"{reason}_drop"] += 1
                continue
            if Tier.CPU in block.copies:
                # A stale CPU copy still read by a demotion in flight: the block gets
                # no second CPU copy, and stays until that transfer ends.
                self.store.rerank(block)
                continue
            cpu = self._cpu_slot(block)
            if cpu is not None:
                pairs.append(self._reserve(block, Tier.GPU, cpu))
                self.metrics.evictions_by_reason[f"{reason}_swap_out"] += 1
            elif block.ref_count == 0:
                self.store.delete_block(block)  # an unreferenced cache entry with nowhere to go
                self.metrics.evictions_by_reason[f"{reason}_discard"] += 1
            else:
                self.store.rerank(block)  # stays; nowhere below has room
        self._submit(Direction.GPU_TO_CPU, priority, pairs, evict=True)

    def _evictable_now(self, block: Block) -> bool:
        gpu = block.copies.get(Tier.GPU)
        return gpu is not None and not gpu.is_busy and block.num_running_refs == 0

    # -------------------------------------------------------------- CPU tier

    def _cpu_slot(self, block: Block) -> Copy | None:
        """A CPU copy for `block`. When the pinned pool is full (its normal state)
        a cold CPU copy that costs nothing to drop makes room; an unreferenced
        cache entry is discarded only to save a referenced block, never to make
        room for another cache entry."""
        copy = self.store.place(block, Tier.CPU, ready=False)
        while copy is None:
            victim = self.store.cpu_policy.pop_victim(max_rank=2)
            if victim is None:
                return None
            if victim.ready_copy(Tier.NVME) is None and victim.ref_count == 0:
                if block.ref_count == 0:
                    self.store.rerank(victim)  # stays: one cache entry for another is no gain
                    return None
                self.store.delete_block(victim)
                self.metrics.evictions_by_reason["cpu_discard"] += 1
            else:
                self.store.drop_copy(victim, Tier.CPU)
                self.metrics.evictions_by_reason["cpu_drop"] += 1
            copy = self.store.place(block, Tier.CPU, ready=False)
        return copy

    def _demote_past_watermark(self) -> None:
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
                pairs.append(self._reserve(victim, Tier.CPU, nvme_copy))
                self.metrics.evictions_by_reason["demote"] += 1
            used -= 1
        for block in skipped:
            self.store.rerank(block)
        self._submit(Direction.CPU_TO_NVME, Priority.LOW, pairs, evict=True)

    # -------------------------------------------------------------- plumbing

    def _reserve(self, block: Block, src_tier: Tier, dst: Copy) -> tuple[Block, Copy]:
        """Mark `block`'s `src_tier` copy as read by a planned transfer at once, so
        nothing done before the chunk is submitted can drop it."""
        block.copies[src_tier].num_readers += 1
        self.store.rerank(block)
        return block, dst

    def _submit(
        self,
        direction: Direction,
        priority: Priority,
        pairs: list[tuple[Block, Copy]],
        *,
        evict: bool,
    ) -> None:
        if not pairs:
            return
        chunk_blocks = (
            self.settings.swap_in_chunk_blocks
            if priority is Priority.HIGH
            and direction in (Direction.CPU_TO_GPU, Direction.NVME_TO_CPU)
            else self.settings.swap_out_chunk_blocks
        )
        self.mover.submit(direction, priority, pairs, evict=evict, chunk_blocks=chunk_blocks)

    def wait_any(self) -> bool:
        """Wait for the oldest transfer in flight; False when none is."""
        if not self.mover.inflight:
            return False
        self.mover.wait(next(iter(self.mover.inflight)))
        return True

    def drain(self) -> None:
        """Wait for every transfer (shutdown, tests)."""
        self.mover.wait_all()

    def check_integrity(self) -> None:
        self.store.check_integrity()
        for seq_id in self._resident:
            state = self.store.sequences.get(seq_id)
            assert state is not None and state.running, f"resident sequence {seq_id} is not running"
            for block in self.store.sequence_blocks(seq_id):
                assert block.ready_copy(Tier.GPU) is not None, (
                    f"block {block.block_id} of resident sequence {seq_id} is not ready on the GPU"
                )
        busy_slots = {
            (record.chunk.direction.dst_tier, slot)
            for record in self.mover.inflight.values()
            for slot in record.chunk.dst_slots
        }
        for tier, slot in busy_slots:
            assert self.store.tiers[tier].owner(slot) is not None, (
                f"{tier.value} slot {slot} is written by a transfer but owned by nobody"
            )
