"""The swapper: the one façade the scheduler talks to about where KV lives.

Called by the scheduler (engine or simulator), once per step, in this order:

    begin_step(step)          apply finished transfers; age residency windows
    open_sequence / allocate  admit work; allocation may evict synchronously
    prefetch(seq_ids)         swap-in for sequences about to run (HIGH queue)
    wait_ready(seq_ids)       block until they are on the GPU (swap-wait time)
    make_cpu_room(n)          only a caller whose step pushes more through the
                              pinned pool than it holds: its copies go below now
    ... the model runs ...
    end_step()                past a tier's high watermark, move its coldest
                              copies to the tier below (GPU -> CPU -> NVMe, LOW
                              queue), write behind to the remote store

The work is split by concept: `SwapIn` (swap_in.py: prefetch and waits),
`Demoter` (demotion.py: each pair of adjacent tiers' watermarks, one rule for
every victim), `Evictor` (eviction.py: synchronous eviction, CPU slots),
`RemoteTier` (remote_tier.py: one per keyed tier below the pinned pool, fastest
first: lookups of prefixes that missed locally, the write-behind), all planning
through the one `Mover` (mover.py), which reserves sources and applies
completions. The scheduler asks questions here (is it resident, how much room,
what is in flight) and never reaches into the store or the mover.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvswap.base.eviction_policy import PolicyOptions
from kvswap.base.tier import CPU_TIER, GPU_TIER, Tier, keyed_tier_list
from kvswap.base.transfer import CopyEngine, Direction, Priority
from kvswap.control.blocks import Block
from kvswap.control.demotion import Demoter
from kvswap.control.eviction import Evictor
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover, SubmitHook
from kvswap.control.remote_tier import KeyedTier, RemoteTier
from kvswap.control.settings import SwapSettings
from kvswap.control.store import BlockStore
from kvswap.control.store_records import StoreLayout
from kvswap.control.swap_in import SwapIn, WaitResult


@dataclass(frozen=True)
class TierOccupancy:
    num_blocks: int
    num_used_blocks: int
    peak_used_blocks: int


class Swapper:
    def __init__(
        self,
        layout: StoreLayout,
        options: PolicyOptions,
        settings: SwapSettings,
        engine: CopyEngine,
        clock_s: Callable[[], float],
        metrics: KVMetrics | None = None,
        *,
        keyed: Sequence[KeyedTier] = (),
        on_submit: SubmitHook | None = None,
    ):
        """`keyed`: the tiers addressed by key below the pinned pool, fastest first
        (`keyed_tier_list` names them); none: no keyed tier. `on_submit`: sees each chunk
        and its blocks as it is submitted."""
        self.settings = settings
        self.options = options
        self._clock_s = clock_s
        # Read-only to everyone but the swapper's parts (tests and exporters look).
        tiers = keyed_tier_list([each.index.local for each in keyed])
        self.store = BlockStore(
            layout, options,
            keyed_indexes={tier: each.index for tier, each in zip(tiers, keyed, strict=True)},
        )  # fmt: skip
        self.metrics = metrics if metrics is not None else KVMetrics()
        self.metrics.keyed_tiers = tiers
        self.mover = Mover(
            self.store, engine, self.metrics, settings.block_bytes, self._arrived,
            swap_in_chunk_blocks=settings.swap_in_chunk_blocks,
            swap_out_chunk_blocks=settings.swap_out_chunk_blocks, on_submit=on_submit,
        )  # fmt: skip
        self.remotes = tuple(
            RemoteTier(self.store, self.mover, self.metrics, each, tier)
            for tier, each in zip(tiers, keyed, strict=True)
        )
        # A keyed tier shared with others (the store, ...; not the NVMe slab): what the
        # remote figures are about.
        self.has_shared_tier = any(not remote.tier.local for remote in self.remotes)
        # The local keyed tier's size where it says it (`occupancy`), asked once.
        self._local_capacity = {
            remote.tier: capacity
            for remote in self.remotes
            if remote.tier.local and (capacity := remote.index.capacity_blocks) is not None
        }
        self.demoter = Demoter(self.store, self.mover, self.metrics, settings, self.remotes)
        self.evictor = Evictor(self.store, self.mover, self.metrics, self.demoter, clock_s)
        self.swap_in = SwapIn(self.store, self.mover, self.evictor, self.metrics, clock_s)
        # Blocks of prefixes found only on a keyed tier, not yet fetched: block id ->
        # the sequences that hit it (each counts as a hit once its fetch lands, for the
        # tier it came from).
        self._remote_hits_due: Counter[int] = Counter()

    # ------------------------------------------------------------ step bracket

    def begin_step(self, step: int) -> None:
        """Take the finished transfers, then drop the copies a local tier evicted."""
        self.store.advance(step)
        self.mover.poll()
        for remote in self.remotes:
            remote.drop_evicted()

    def end_step(self) -> None:
        """The step's KV is computed: publish its full blocks, then swap out and demote."""
        self.store.publish_computed()
        self.mover.poll()
        self.demoter.demote_past_watermarks()
        for remote in self.remotes:
            remote.flush()
        for tier, slots in self.store.tiers.items():
            peak = self.metrics.peak_used_blocks_by_tier
            peak[tier] = max(peak[tier], slots.peak_used_slots)

    def tend(self) -> None:
        """Nothing runs (the driver is idle): take finished transfers and send the
        write-behind they queued, so an idle server still writes its finished
        prefixes to the remote store (and forgets what a local tier evicted)."""
        self.mover.poll()
        for remote in self.remotes:
            remote.drop_evicted()
            remote.flush()

    # ------------------------------------------------------------- sequences

    def open_sequence(
        self, seq_id: int, prompt_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> int:
        """Start a sequence; returns how many prompt tokens its prefix hits cover.
        Past the local hits, the keyed tiers are asked in order for the next blocks,
        each for what follows what the others served, and past those the local tiers
        again (a run of blocks here may follow one only a keyed tier still holds),
        until none has the next block. A tier is not asked twice at the same place:
        its last answer ended where it lacks the next block."""
        hits = self.store.open_sequence(seq_id, prompt_ids, cache_salt=cache_salt)
        table = self.store.sequences[seq_id].block_ids
        lacks_at: dict[int, int] = {}  # keyed tier (position) -> table length it lacks at
        while True:
            served = False
            for position, remote in enumerate(self.remotes):
                if lacks_at.get(position) == len(table):
                    continue
                found = remote.extend_prefix(seq_id, prompt_ids)
                lacks_at[position] = len(table)
                hits += found
                served = served or bool(found)
            if not served:
                break
            hits += self.store.attach_indexed_prefix(seq_id, prompt_ids)
        for block in hits:
            tier = block.fastest_copy_tier()
            assert tier is not None, "the prefix index holds no lost block"
            if tier.keyed:
                # Counted once its fetch lands: a fetch that fails is recomputed.
                self._remote_hits_due[block.block_id] += 1
            else:
                self.metrics.prefix_hit_blocks_by_tier[tier] += 1
        if len(self._remote_hits_due) > 2 * len(self.store.blocks) + 64:  # O(1) amortised
            for block_id in self._remote_hits_due.keys() - self.store.blocks.keys():
                del self._remote_hits_due[block_id]
        return len(hits) * self.store.block_tokens

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> bool:
        """Append tokens, giving new blocks GPU slots; False (nothing changed) if no room."""
        needed = self.store.num_new_blocks_needed(seq_id, len(token_ids))
        if needed and not self.ensure_gpu_slots(needed):
            return False
        for block in self.store.append_tokens(seq_id, token_ids):
            copy = self.store.place(block, GPU_TIER, ready=True)
            assert copy is not None, "slots were reserved above"
        return True

    def set_running(self, seq_id: int, running: bool) -> None:
        self.swap_in.forget(seq_id)
        if not running and self.options.sink_protection:
            protected = self.store.sequence_blocks(seq_id)[: self.store.layout.protected_blocks]
            self.metrics.protected_block_saves += sum(GPU_TIER in b.copies for b in protected)
        self.store.set_running(seq_id, running)

    def release(self, seq_id: int, *, reason: str | None = None) -> None:
        """End a sequence without offloading (recompute preemption, or `reason` for a
        counted eviction such as the recompute fallback): its full blocks stay only
        as prefix cache, wherever they are."""
        self.swap_in.forget(seq_id)
        self.store.close_sequence(seq_id)
        if reason is not None:
            self.metrics.evictions_by_reason[reason] += 1

    def discard(self, seq_id: int) -> None:
        """End a sequence and free its KV on every tier (its client left): the blocks
        no other sequence references are deleted, not kept as prefix cache."""
        self.swap_in.forget(seq_id)
        for block in self.store.close_sequence(seq_id):
            self.store.delete_block(block)

    def finish(self, seq_id: int) -> None:
        """End a sequence and offload its reusable blocks at once (LOW queue); with a
        remote tier written on finish, its full blocks follow to the store."""
        self.swap_in.forget(seq_id)
        table = self.store.sequence_blocks(seq_id)
        released = self.store.close_sequence(seq_id)
        pairs = []
        for block in released:
            gpu = block.ready_copy(GPU_TIER)
            if gpu is None or block.has_ready_copy_below(GPU_TIER) or CPU_TIER in block.copies:
                continue
            cpu = self.evictor.cpu_slot(block)
            if cpu is None:
                break
            pairs.append(self.mover.reserve(block, GPU_TIER, cpu))
        # Slots went head first (a prefix's head is worth most); the copies land tail
        # first, so the head is the most recent on the CPU: a chain leaves the pinned
        # pool (and NVMe after it) from its tail, and what stays is a usable prefix.
        self.mover.submit(Direction.GPU_TO_CPU, Priority.LOW, pairs[::-1], evict=False)
        for remote in self.remotes:
            remote.finished(table)

    def swap_out_sequence(self, seq_id: int) -> None:
        """Preempt by swapping: pause the sequence and move its unprotected GPU
        blocks down now (clean ones are dropped, dirty ones copied, LOW queue)."""
        self.set_running(seq_id, False)
        blocks = self.store.sequence_blocks(seq_id)[self.store.layout.protected_blocks :]
        self.evictor.evict([b for b in blocks if self.evictor.evictable_now(b)], reason="preempt")

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop a sequence's tokens from `num_tokens` on (to recompute lost blocks).
        The blocks it keeps are where they were, so its residency still holds."""
        self.store.truncate(seq_id, num_tokens)

    # --------------------------------------------------------------- swap-in

    def prefetch(self, seq_ids: Iterable[int]) -> None:
        """Start bringing these sequences' blocks to the GPU (HIGH queue), without waiting."""
        self.swap_in.prefetch(seq_ids)

    def wait_ready(self, seq_ids: Sequence[int]) -> WaitResult:
        """Block until the blocks of `seq_ids` are on the GPU; the caller pauses the
        `not_ready` ones again."""
        return self.swap_in.wait_ready(seq_ids)

    def ensure_gpu_slots(self, num_blocks: int) -> bool:
        """Make `num_blocks` GPU slots free now, evicting synchronously if needed."""
        return self.evictor.ensure_gpu_slots(num_blocks)

    def make_cpu_room(self, num_blocks: int) -> int:
        """Free up to `num_blocks` pinned-pool slots now: its coldest copies go to the
        tier below (NVMe, the store) on the HIGH queue, by the demotion rule, and the
        call waits for them. For a caller whose one step pushes more through the pinned
        pool than it holds (a layer-wise cache), where `end_step`'s demotion comes too
        late; the time counts as swap wait. Copies still landing in the pool hold
        slots that cannot leave before they land: when the room is still short, the
        call lets them land and demotes once more (a slow disk or busy cores must not
        turn into no room). Returns the slots freed (0: the room was there, or nothing
        could leave)."""
        self.mover.poll()
        cpu = self.store.tiers[CPU_TIER]
        free_before = cpu.num_free_slots
        wanted = min(num_blocks, cpu.num_slots)
        if free_before >= wanted:
            return 0
        start_s = self._clock_s()
        for _ in range(2):
            self.demoter.make_room_now(CPU_TIER, wanted)
            for transfer_id, record in list(self.mover.inflight.items()):
                if cpu.num_free_slots >= wanted:
                    break
                direction = record.chunk.direction
                if record.evict and direction.src_tier is CPU_TIER and not direction.upward:
                    self.mover.wait(transfer_id)
            landing = [
                transfer_id
                for transfer_id, record in self.mover.inflight.items()
                if record.chunk.direction.dst_tier is CPU_TIER
            ]
            if cpu.num_free_slots >= wanted or not landing:
                break
            for transfer_id in landing:
                self.mover.wait(transfer_id)
        self.metrics.swap_wait_s += self._clock_s() - start_s
        return max(0, cpu.num_free_slots - free_before)

    def _arrived(self, block: Block, tier: Tier, source: Tier) -> None:
        if tier is CPU_TIER and block.block_id in self._remote_hits_due:
            hits = self._remote_hits_due.pop(block.block_id)
            self.metrics.prefix_hit_blocks_by_tier[source] += hits
        self.swap_in.arrived(block, tier)
        for remote in self.remotes:
            remote.arrived(block, tier)

    # ------------------------------------------------------------- questions

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    @property
    def num_gpu_blocks(self) -> int:
        return self.store.tiers[GPU_TIER].num_slots

    @property
    def protected_blocks(self) -> int:
        return self.store.layout.protected_blocks

    @property
    def num_open_sequences(self) -> int:
        return len(self.store.sequences)

    def holds_kv(self, seq_id: int) -> bool:
        """Whether the sequence is open (it has a block table, on whatever tier)."""
        return seq_id in self.store.sequences

    def num_tokens_held(self, seq_id: int) -> int:
        """Tokens whose KV the sequence's table holds (computed or being computed)."""
        return self.store.sequences[seq_id].num_tokens

    def num_missing_gpu_blocks(self, seq_id: int) -> int:
        return self.swap_in.num_missing_gpu_blocks(seq_id)

    def may_join_running(self, num_blocks: int, *, batch_is_empty: bool) -> bool:
        """May a sequence needing `num_blocks` more GPU blocks (re)join the running set?

        Only if the blocks nobody can evict (running, protected, young) stay at or
        below the low watermark after it joins: the running sequences keep room
        to grow, so a resumed sequence is not preempted again a few tokens later.
        The first sequence may always run if it fits at all (no idle deadlock).
        """
        gpu = self.store.tiers[GPU_TIER]
        room = gpu.num_free_slots + self.store.num_eviction_candidates(GPU_TIER)
        if batch_is_empty:
            return num_blocks <= room
        pinned_blocks = gpu.num_slots - room
        return pinned_blocks + num_blocks <= self.settings.swap_out_low_watermark * gpu.num_slots

    def may_prefetch(self, seq_id: int) -> bool:
        """Whether the sequence's missing blocks fit free GPU slots with the
        swap-out headroom left over: a prefetched block that has to leave again
        before use is a wasted transfer."""
        gpu = self.store.tiers[GPU_TIER]
        headroom = math.ceil((1.0 - self.settings.swap_out_high_watermark) * gpu.num_slots)
        return self.num_missing_gpu_blocks(seq_id) + headroom <= gpu.num_free_slots

    @property
    def has_transfers_in_flight(self) -> bool:
        return self.mover.has_inflight

    def has_lost_blocks(self) -> bool:
        return self.store.has_lost_blocks()

    def first_lost_token(self, seq_id: int) -> int | None:
        return self.store.first_lost_token(seq_id)

    def gpu_block_table(self, seq_id: int) -> list[int]:
        """GPU slots of the sequence's blocks, in order (all ready: after wait_ready)."""
        return self.store.gpu_block_table(seq_id)

    def occupancy(self) -> Mapping[Tier, TierOccupancy]:
        """Each slot tier's slots in use, and the local keyed tier's (the NVMe slab)
        where it says its size: the keys the store placed there (`LocalKeys`; at
        most its size: a key it evicted for a newer one counts until the next step)."""
        occupancy = {
            tier: TierOccupancy(slots.num_slots, slots.num_used_slots, slots.peak_used_slots)
            for tier, slots in self.store.tiers.items()
        }
        local = self.store.local_keys
        for tier, capacity in self._local_capacity.items():
            occupancy[tier] = TierOccupancy(
                capacity, min(len(local), capacity), min(local.peak_keys, capacity)
            )
        return occupancy

    # ------------------------------------------------------------- plumbing

    def wait_any(self) -> bool:
        """Wait for the oldest transfer in flight; False when none is."""
        if not self.mover.inflight:
            return False
        self.mover.wait(next(iter(self.mover.inflight)))
        return True

    def drain(self) -> None:
        """Wait for every transfer (shutdown, tests). The write-behind still queued goes
        to the remote store first, so a process that ends leaves its finished
        prefixes to the next one."""
        self.mover.wait_all()
        while any(remote.num_queued_blocks for remote in self.remotes):
            for remote in self.remotes:
                remote.flush()  # the queue shrinks each time: nothing is in flight here
            self.mover.wait_all()

    def check_integrity(self) -> None:
        self.store.check_integrity()
        for seq_id in self.swap_in.resident:
            state = self.store.sequences.get(seq_id)
            assert state is not None and state.running, f"resident sequence {seq_id} is not running"
            for block in self.store.sequence_blocks(seq_id):
                assert block.ready_copy(GPU_TIER) is not None, (
                    f"block {block.block_id} of resident sequence {seq_id} is not ready on the GPU"
                )
        busy_slots = {
            (record.chunk.direction.dst_tier, slot)
            for record in self.mover.inflight.values()
            for slot in record.chunk.dst_slots
            if record.chunk.direction.dst_tier in self.store.tiers  # not a keyed tier
        }
        for tier, slot in busy_slots:
            assert self.store.tiers[tier].owner(slot) is not None, (
                f"{tier.value} slot {slot} is written by a transfer but owned by nobody"
            )
