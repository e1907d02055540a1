"""One KV block as the control plane sees it: tokens, hash, references, copies.

A block may have a copy on several tiers at once. A full block never changes,
so a copy on a lower tier stays valid after the block is brought back up:
evicting the upper copy later is a free drop, not another transfer. The last,
partial block of a sequence changes on every append; appending invalidates
its lower copies.

    Block 7 --copies--> {GPU: slot 12 (ready), CPU: slot 40 (ready), NVMe: -}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvswap.control.transfer import Tier

#: Chain seed for a sequence's first block.
ROOT_HASH = 0


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given its predecessor's hash: equal prefixes, equal hashes.

    Python's tuple-of-int hash is deterministic across processes (no string
    randomization is involved). Collisions are possible, so every hit is
    confirmed against the stored token ids.
    """
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Copy:
    """One tier's copy of a block. `ready` is False while a transfer writes it;
    `num_readers` counts transfers reading it; neither kind may be freed yet.
    `stale` marks a busy copy whose block changed meanwhile: it is dropped as
    soon as its transfers finish and is never read as valid."""

    slot: int
    ready: bool = True
    num_readers: int = 0
    stale: bool = False

    @property
    def is_busy(self) -> bool:
        return not self.ready or self.num_readers > 0


@dataclass(slots=True)
class Block:
    """A logical KV block, shared by every sequence whose prefix contains it."""

    block_id: int
    parent_hash: int
    token_ids: list[int] = field(default_factory=list)
    prefix_hash: int | None = None  # set when the block becomes full
    ref_count: int = 0  # sequences (running or paused) whose table holds it
    num_running_refs: int = 0  # of those, sequences that run this step
    num_protected_refs: int = 0  # sequences holding it among their first protected blocks
    copies: dict[Tier, Copy] = field(default_factory=dict)
    resident_until_step: int = 0  # not evictable from GPU before this decode step
    lost: bool = False  # every copy failed: the owner must recompute it

    def is_full(self, block_tokens: int) -> bool:
        return len(self.token_ids) == block_tokens

    def ready_copy(self, tier: Tier) -> Copy | None:
        copy = self.copies.get(tier)
        return copy if copy is not None and copy.ready and not copy.stale else None

    def has_ready_copy_below(self, tier: Tier) -> bool:
        """A ready copy on a tier slower than `tier` (so `tier`'s copy can be dropped)."""
        order = (Tier.GPU, Tier.CPU, Tier.NVME)
        below = order[order.index(tier) + 1 :]
        return any(self.ready_copy(lower) is not None for lower in below)
