"""Which GPU copy leaves first: LRU, plus sink protection, minimum residency, cost.

The store calls `update(block)` whenever something the policy looks at
changes (references, copies), `touch(block)` when a step reads it,
`on_swapped_in(block)` when its GPU copy arrives (the residency window
starts), `forget(block)` when the GPU copy goes; the swapper calls
`advance(step)` once per decode step and `pop_victim()` when it needs room.
Every call is O(1) (amortised): candidates live in a few LRU-ordered dicts,
one per cost rank, and blocks inside their minimum residency window wait in
a FIFO that `advance` drains. No call scans all
blocks, so 100k blocks cost the same per decision as 10.

Cost ranks (cheapest victim first) when cost awareness is on:

    0  unreferenced, a ready copy below  -> dropped, no transfer
    1  unreferenced, GPU copy only       -> copied out, then freed
    2  paused sequence, a copy below     -> dropped; swapped in again on resume
    3  paused sequence, GPU copy only    -> copied out; swapped in again on resume
    -  running, protected, busy, young   -> not a candidate

Unreferenced blocks (finished requests, prefix cache) go first because nobody
is known to need them; paused sequences will need theirs back on resume, and
swap-in is the expensive direction.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvswap.control.blocks import Block
from kvswap.control.transfer import Tier

NUM_RANKS = 4


@dataclass(frozen=True)
class PolicyOptions:
    """Switches that turn plain LRU into kvswap's policy, one at a time."""

    sink_protection: bool = True
    min_residency_steps: int = 64
    cost_aware: bool = True


class RankedLru:
    """Blocks in a few LRU-ordered lists, one per cost rank; every call O(1)."""

    def __init__(self, num_ranks: int):
        self.lists: list[OrderedDict[int, Block]] = [OrderedDict() for _ in range(num_ranks)]
        self.rank_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.rank_of)

    def place(self, block: Block, rank: int | None, *, refresh: bool) -> None:
        """Put `block` at `rank` (None: not a candidate). An unchanged rank keeps its
        LRU position unless `refresh`, which makes it the most recently used."""
        block_id = block.block_id
        old = self.rank_of.get(block_id)
        if old == rank:
            if refresh and rank is not None:
                self.lists[rank].move_to_end(block_id)
            return
        if old is not None:
            del self.lists[old][block_id]
        if rank is None:
            del self.rank_of[block_id]
        else:
            self.lists[rank][block_id] = block
            self.rank_of[block_id] = rank

    def remove(self, block: Block) -> None:
        old = self.rank_of.pop(block.block_id, None)
        if old is not None:
            del self.lists[old][block.block_id]

    def move_to_end(self, block: Block) -> None:
        rank = self.rank_of.get(block.block_id)
        if rank is not None:
            self.lists[rank].move_to_end(block.block_id)

    def pop(self, max_rank: int) -> Block | None:
        """The least recently used block of the cheapest non-empty rank <= max_rank."""
        for ranked in self.lists[: max_rank + 1]:
            if ranked:
                block_id, block = ranked.popitem(last=False)
                del self.rank_of[block_id]
                return block
        return None

    def check_integrity(self) -> None:
        assert sum(map(len, self.lists)) == len(self.rank_of), "rank index out of step"
        for rank, ranked in enumerate(self.lists):
            for block_id in ranked:
                assert self.rank_of[block_id] == rank


class ResidencyPolicy:
    """Ranked LRU over the GPU copies of blocks."""

    def __init__(self, options: PolicyOptions):
        self.options = options
        self._lru = RankedLru(NUM_RANKS)
        # (resident_until_step, block): FIFO in expiry order, since every
        # window has the same length and blocks enter in step order.
        self._young: deque[tuple[int, Block]] = deque()
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    def num_candidates(self) -> int:
        return len(self._lru)

    def advance(self, step: int) -> None:
        """Move to decode step `step`; blocks whose residency window ended become candidates."""
        self._step = step
        while self._young and self._young[0][0] <= step:
            _, block = self._young.popleft()
            self.update(block)

    def on_swapped_in(self, block: Block) -> None:
        """A GPU copy just arrived from a lower tier: start its residency window."""
        window = self.options.min_residency_steps
        if window > 0:
            block.resident_until_step = self._step + window
            self._young.append((block.resident_until_step, block))
        self.update(block)

    def touch(self, block: Block) -> None:
        """The block was read by attention this step (most recently used)."""
        self._lru.move_to_end(block)

    def update(self, block: Block) -> None:
        """Re-rank `block` after a change; O(1). Its LRU position holds if its rank does."""
        if Tier.GPU not in block.copies and block.block_id not in self._lru.rank_of:
            return  # the common case for a block below the GPU: nothing to rank
        self._lru.place(block, self._rank(block), refresh=False)

    def forget(self, block: Block) -> None:
        self._lru.remove(block)

    def pop_victim(self) -> Block | None:
        """The cheapest, least recently used candidate, removed from the candidates."""
        return self._lru.pop(NUM_RANKS - 1)

    def _rank(self, block: Block) -> int | None:
        gpu = block.copies.get(Tier.GPU)
        if gpu is None or gpu.is_busy or block.lost or block.num_running_refs > 0:
            return None
        if block.num_protected_refs > 0 and self.options.sink_protection:
            return None
        if block.resident_until_step > self._step and block.ref_count > 0:
            return None  # the window protects blocks someone brought back to use
        if not self.options.cost_aware:
            return 0
        clean = block.has_ready_copy_below(Tier.GPU)
        if block.ref_count == 0:
            return 0 if clean else 1
        return 2 if clean else 3

    def check_integrity(self) -> None:
        self._lru.check_integrity()
        for ranked in self._lru.lists:
            for block_id, block in ranked.items():
                assert Tier.GPU in block.copies, f"candidate {block_id} has no GPU copy"


class CpuResidencyPolicy:
    """LRU over CPU copies, to make room in the pinned pool and to demote to NVMe.

    Ranks, cheapest first:
        0  a ready NVMe or remote copy exists  -> drop the CPU copy
        1  unreferenced, CPU is the only copy  -> demote, or discard the cache entry
        2  a ready GPU copy exists             -> drop (the GPU copy becomes dirty)
        3  referenced, CPU is the only copy    -> demote only; never discarded
    Busy copies are not candidates.
    """

    def __init__(self) -> None:
        self._lru = RankedLru(4)

    def update(self, block: Block) -> None:
        """Re-rank after a change and mark as most recently used; O(1)."""
        if Tier.CPU not in block.copies and block.block_id not in self._lru.rank_of:
            return  # the common case for a GPU-only block: nothing to rank
        self._lru.place(block, self._rank(block), refresh=True)

    def forget(self, block: Block) -> None:
        self._lru.remove(block)

    def pop_victim(self, max_rank: int = 3) -> Block | None:
        """The cheapest LRU candidate with rank <= max_rank, removed from the candidates."""
        return self._lru.pop(max_rank)

    def num_candidates(self) -> int:
        return len(self._lru)

    @staticmethod
    def _rank(block: Block) -> int | None:
        cpu = block.copies.get(Tier.CPU)
        if cpu is None or cpu.is_busy or block.lost:
            return None
        if block.has_ready_copy_below(Tier.CPU):
            return 0
        if block.ref_count == 0:
            return 1
        if block.ready_copy(Tier.GPU) is not None:
            return 2
        return 3
