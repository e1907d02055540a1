"""A keyed tier in the control plane: prefix lookups, and the write-behind.

Each tier addressed by key below the pinned pool (the shared store, a tier of
one's own, fastest first: `keyed_tier(position)`) is one `RemoteTier` here, with
its own `RemoteIndex`, write policy and bound on writes in flight; a block's
copies say which of them hold it. The swapper asks them in order for a prompt's
next blocks (`Swapper.open_sequence`), and swap-in reads a block from the fastest
that holds it.

Reads. When a prompt's prefix misses on every local tier, the keys of its next
full blocks (never the block holding the last prompt token) are asked of the
`RemoteIndex` a page of at most `max_lookup_blocks` keys per call (one
pipelined round trip each); the next page is asked only while the store holds
every key of the one before, so a miss costs one round trip and a long prompt
found whole costs one per page. The blocks it holds join the sequence with a
ready remote copy; swap-in brings them up as it brings NVMe blocks (remote ->
CPU on HIGH, then CPU -> GPU). A fetch that fails makes the block lost, and
its owner recomputes it.

Writes never sit on the decode path. They read a ready CPU copy, on the LOW
queue in swap-out chunks, and hold that CPU slot until the result is polled:

    on_finish   finish(seq)  -> its full blocks: a ready CPU copy   -> queued
                                                  a CPU copy coming  -> queued on arrival
    on_demote   the Demoter writes each block it takes from the pinned pool
    end_step    flush(): queued blocks -> CPU_TO_REMOTE chunks, at most
                `max_inflight_write_chunks` chunks in flight
    completion  written: the block has a ready remote copy (a CPU drop loses nothing)
                failed or skipped by the store: no remote copy

A block with a copy on this tier (ready, or being written) is never written to
it again. While `RemoteIndex.available` is False nothing is looked up or written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.tier import Tier
from kvswap.base.transfer import Priority, direction_between
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.settings import RemoteSettings
from kvswap.control.store import BlockStore


@dataclass(frozen=True)
class KeyedTier:
    """A tier addressed by key, as the control plane is handed it: its presence index
    (the engine's over a `SecondaryTier`, the simulator's over a modelled store) and
    how it is used."""

    index: RemoteIndex
    settings: RemoteSettings


class RemoteTier:
    def __init__(
        self, store: BlockStore, mover: Mover, metrics: KVMetrics, keyed: KeyedTier, tier: Tier
    ):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.settings = keyed.settings
        self.index = keyed.index
        self.tier = tier
        self._down = direction_between(Tier.CPU, tier)
        # Blocks to write, oldest first; each had a ready CPU copy when queued (checked
        # again at flush: nothing is reserved while queued, so a CPU drop may win). An
        # OrderedDict: `flush` takes from the front, which a dict does in time growing
        # with the entries deleted before it (a queue of 100k blocks: quadratic).
        self._queue: OrderedDict[int, Block] = OrderedDict()
        # Blocks to queue once their CPU copy lands (the finish offload gives them one).
        self._on_cpu_arrival: set[int] = set()

    # ------------------------------------------------------------------- reads

    def extend_prefix(self, seq_id: int, prompt_ids: Sequence[int]) -> list[Block]:
        """The blocks this tier holds next after the sequence's table (the local prefix
        hits, and what other tiers served), attached to it (empty when it holds none or
        is down). It lacks the block after them, if any."""
        if not self.index.available or self.store.tiers[Tier.CPU].num_slots == 0:
            return []  # a fetch lands in a CPU slot: without a pinned pool, no reads
        attached: list[Block] = []
        page_blocks = self.settings.max_lookup_blocks
        while True:  # page after page, while the store holds each page whole
            candidates = self.store.next_prompt_blocks(seq_id, prompt_ids, page_blocks)
            if not candidates:
                return attached
            num_found = self.index.lookup([key for key, _ in candidates])
            num_found = max(0, min(int(num_found), len(candidates)))
            if not self.tier.local:  # the remote figures are the shared tiers'
                self.metrics.remote_lookups += 1
                self.metrics.remote_lookup_blocks += len(candidates)
                self.metrics.remote_found_blocks += num_found
                self.metrics.remote_lookup_misses += num_found == 0
            if num_found == 0:
                return attached
            attached += self.store.attach_remote_blocks(seq_id, candidates[:num_found], self.tier)
            if num_found < len(candidates):
                return attached

    def drop_evicted(self) -> None:
        """A local tier (`RemoteIndex.local`) evicted keys: their copies here go (a block
        left with no copy is forgotten, as a slot tier's discard forgets it)."""
        if not self.tier.local:
            return
        keys = self.index.evicted_keys()
        if keys:
            dropped = self.store.drop_evicted(self.tier, keys)
            self.metrics.evictions_by_reason[f"{self.tier.value}_discard"] += dropped

    # ------------------------------------------------------------------ writes

    @property
    def demotes(self) -> bool:
        """Whether the Demoter writes what leaves the pinned pool (on_demote, store up)."""
        return self.settings.write_policy is RemoteWritePolicy.ON_DEMOTE and self.index.available

    def finished(self, blocks: Iterable[Block]) -> None:
        """A sequence finished with these blocks (its table, before it closed): under
        on_finish, write its full ones once they have a CPU copy."""
        if self.settings.write_policy is not RemoteWritePolicy.ON_FINISH:
            return
        for block in blocks:
            if not self._due(block):
                continue
            cpu = block.copies.get(Tier.CPU)
            if cpu is not None and cpu.ready and not cpu.stale:
                self._queue[block.block_id] = block
            elif cpu is None or not cpu.stale:
                # On its way to the CPU (the finish offload), or there later when it is
                # evicted (a block another sequence still runs with): written then.
                self._on_cpu_arrival.add(block.block_id)
        self._forget_gone()

    def arrived(self, block: Block, tier: Tier) -> None:
        """A copy of `block` became ready on `tier` (called by the mover)."""
        if tier is Tier.CPU and block.block_id in self._on_cpu_arrival:
            self._on_cpu_arrival.discard(block.block_id)
            if self._due(block):
                self._queue[block.block_id] = block
                self._forget_gone()

    def flush(self) -> None:
        """Submit queued writes (LOW queue) within the in-flight bound; the rest wait."""
        if not self._queue:
            return
        if not self.index.available:
            self.metrics.remote_writes_skipped += len(self._queue)
            self._queue.clear()
            return
        pairs: list[tuple[Block, Copy]] = []
        room_blocks = self.write_room_blocks()
        while self._queue and len(pairs) < room_blocks:
            _, block = self._queue.popitem(last=False)
            if not self._due(block):
                continue  # written meanwhile, or gone: nothing to do
            pair = self.plan_write(block)
            if pair is None:
                self.metrics.remote_writes_skipped += 1  # its CPU copy went first
                continue
            pairs.append(pair)
        self.submit_writes(pairs, evict=False)

    def write_room_blocks(self) -> int:
        """Blocks that may still be sent now: the in-flight bound less what is in flight."""
        inflight = self.mover.num_inflight_by_direction[self._down]
        room_chunks = max(0, self.settings.max_inflight_write_chunks - inflight)
        return room_chunks * self.mover.chunk_blocks(self._down, Priority.LOW)

    def plan_write(self, block: Block) -> tuple[Block, Copy] | None:
        """Reserve `block`'s ready CPU copy and give it a remote copy being written;
        None when it has no ready CPU copy or is already in (or going to) the store."""
        cpu = block.ready_copy(Tier.CPU)
        if cpu is None or not self._due(block):
            return None
        remote = self.store.place(block, self.tier, ready=False)
        assert remote is not None, "a remote copy takes no slot"
        return self.mover.reserve(block, Tier.CPU, remote)

    def submit_writes(
        self,
        pairs: Sequence[tuple[Block, Copy]],
        *,
        evict: bool,
        priority: Priority = Priority.LOW,
    ) -> None:
        """Send planned writes; `evict`: free each CPU copy once its write succeeded
        (`priority` HIGH: a caller waits for that room now)."""
        self.mover.submit(self._down, priority, pairs, evict=evict)

    @property
    def num_queued_blocks(self) -> int:
        return len(self._queue)

    # ---------------------------------------------------------------- internal

    def _due(self, block: Block) -> bool:
        """Whether `block` is one to write: alive, full, and not known to this tier."""
        return (
            block.block_id in self.store.blocks
            and block.key is not None
            and not block.lost
            and self.tier not in block.copies
        )

    def _forget_gone(self) -> None:
        """Keep the bookkeeping bounded while the store is slow or copies go first: a
        queued block is worth keeping only with a ready CPU copy (so at most the pinned
        pool's slots of them), a waiting id only while its block lives (ids are never
        reused). Each purge is O(entries) and at least halves them, so O(1) amortised."""
        if len(self._queue) > 2 * self.store.tiers[Tier.CPU].num_slots + 64:
            for block_id, block in list(self._queue.items()):
                if not self._due(block) or block.ready_copy(Tier.CPU) is None:
                    del self._queue[block_id]
                    self.metrics.remote_writes_skipped += int(self._due(block))
        if len(self._on_cpu_arrival) > 2 * len(self.store.blocks) + 64:
            self._on_cpu_arrival &= self.store.blocks.keys()
