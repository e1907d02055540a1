"""One KV block as the control plane sees it: tokens, key, references, copies.

A block may have a copy on several tiers at once. A full block never changes,
so a copy on a lower tier stays valid after the block is brought back up:
evicting the upper copy later is a free drop, not another transfer. The last,
partial block of a sequence changes on every append; appending invalidates
its lower copies.

    Block 7 --copies--> {GPU: slot 12 (ready), CPU: slot 40 (ready), NVMe: key, remote: key}

A copy on a keyed tier (the NVMe slab, a store shared by processes) is
addressed by the block's key, not by a slot (its `slot` is None). It counts as
a copy below: dropping the copies above it is free (the demoter still writes a
copy to a faster keyed tier that lacks it first), and if the tier lost the key
after all, the fetch fails and the block is recomputed (lost), never read wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvswap.base.tier import Tier, tier_rank


@dataclass(slots=True)
class Copy:
    """One tier's copy of a block. `ready` is False while a transfer writes it;
    `num_readers` counts transfers reading it; neither kind may be freed yet.
    `stale` marks a busy copy whose block changed meanwhile: it is dropped as
    soon as its transfers finish and is never read as valid."""

    slot: int | None  # None on a tier addressed by key (`Addressing.KEYS`)
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
    parent_key: bytes  # the namespace root (first block) or the previous block's key
    token_ids: list[int] = field(default_factory=list)
    key: bytes | None = None  # identity.chain_key(parent_key, token_ids), set when full
    # The block this one was computed after (None for a first block). A key names
    # a prefix only as long as no two prefixes collide; following parents down to
    # the root proves it, so a hit is confirmed by the real prefix, not the key.
    parent: Block | None = field(default=None, repr=False, compare=False)
    ref_count: int = 0  # sequences (running or paused) whose table holds it
    num_running_refs: int = 0  # of those, sequences that run this step
    num_protected_refs: int = 0  # sequences holding it among their first protected blocks
    copies: dict[Tier, Copy] = field(default_factory=dict)
    lost: bool = False  # every copy failed: the owner must recompute it
    # Derived from `parent` at construction: the position in its chain (0: a first
    # block) and a farther ancestor, so that `is_ancestor` takes O(log depth) steps
    # (skew-binary jump pointers, Myers 1983) instead of a walk down the chain.
    depth: int = field(init=False, repr=False, compare=False)
    jump: Block | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parent = self.parent
        if parent is None:
            self.depth, self.jump = 0, None
            return
        self.depth = parent.depth + 1
        far = parent.jump
        if (
            far is not None
            and far.jump is not None
            and (parent.depth - far.depth == far.depth - far.jump.depth)
        ):
            self.jump = far.jump
        else:
            self.jump = parent

    def is_full(self, block_tokens: int) -> bool:
        return len(self.token_ids) == block_tokens

    def ready_copy(self, tier: Tier) -> Copy | None:
        copy = self.copies.get(tier)
        return copy if copy is not None and copy.ready and not copy.stale else None

    def fastest_copy_tier(self) -> Tier | None:
        """Where the block's KV is served from: the fastest tier with a ready copy, else
        the fastest with one being written (its bytes are on the way); None when every
        copy went stale."""
        for ready_only in (True, False):
            found = [tier for tier, copy in self.copies.items()
                     if not copy.stale and (copy.ready or not ready_only)]  # fmt: skip
            if found:
                return min(found, key=tier_rank)
        return None

    def has_local_copy(self) -> bool:
        """A copy on a tier of this process (any state): what keeps an unreferenced
        block worth remembering. A block known only remotely is found again by a lookup."""
        for tier in self.copies:  # noqa: SIM110 - a loop: called on every drop
            if tier.local:
                return True
        return False

    def has_ready_copy_below(self, tier: Tier, *, local: bool = False) -> bool:
        """A ready copy on a tier slower than `tier` (so `tier`'s copy can be dropped);
        `local`: on a tier of this process. Called for every re-rank: written as a
        plain loop over the block's few copies."""
        rank = tier.rank
        if local:
            for lower, copy in self.copies.items():
                if lower.rank > rank and lower.local and copy.ready and not copy.stale:
                    return True
            return False
        for lower, copy in self.copies.items():
            if lower.rank > rank and copy.ready and not copy.stale:
                return True
        return False


def same_prefix(a: Block, b: Block) -> bool:
    """Whether `a` and `b` hold the KV of the same token prefix under the same root.

    True when they are one block, or when their tokens are equal block by block
    down to a common ancestor or to first blocks with the same root key. Keys are
    not trusted here: this is what turns a key collision into a miss. Usually
    cheap: two chains computed apart (two sequences admitted in one step with the
    same prompt) compare their tokens until they meet, at most once per match.
    """
    while a is not b:
        if a.token_ids != b.token_ids:
            return False
        if a.parent is None or b.parent is None:
            return a.parent is None and b.parent is None and a.parent_key == b.parent_key
        a, b = a.parent, b.parent
    return True


def is_ancestor(ancestor: Block, block: Block) -> bool:
    """Whether `ancestor` is one of the blocks `block`'s chain extends (not `block`
    itself). O(log depth): the jump pointers skip down the chain."""
    depth = ancestor.depth
    node = block.parent
    if node is None or node.depth < depth:
        return False
    while node.depth > depth:
        jump, parent = node.jump, node.parent
        assert jump is not None and parent is not None, "a block past the first has both"
        node = jump if jump.depth >= depth else parent
    return node is ancestor
