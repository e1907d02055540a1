"""Room in the pinned pool: what leaves it for a newer copy.

A pinned pool full of KV is its normal state, so placing a copy there usually
means letting another go first. `make_room` is the one rule for it, used by
the GPU's demotion into the pool (`demotion.TierPair`) and by swap-in's first
hop (a keyed tier -> CPU). (The keyed tiers below make room by their own
policies.)
"""

from __future__ import annotations

from kvswap.base.tier import Tier
from kvswap.control.blocks import Block, Copy, is_ancestor
from kvswap.control.metrics import KVMetrics
from kvswap.control.store import BlockStore


def make_room(
    store: BlockStore, metrics: KVMetrics, tier: Tier, block: Block, *, displace_cache: bool
) -> Copy | None:
    """A copy of `block` placed on `tier` (a slot tier below the GPU: the pinned pool)
    being written, or None.

    When `tier` has no free slot, its policy's cheapest droppable copies leave
    (`store.victims(tier, droppable_only=True)`) until one is free. A copy with a ready
    copy further down, or of a block referenced elsewhere (a ready copy above), is
    dropped (`{tier}_drop`); an unreferenced block with nothing further down is
    discarded, every copy of it (`{tier}_discard`). The only copy of a referenced
    block never leaves, and nothing busy does. With `displace_cache` False an
    unreferenced `block` never displaces another unreferenced one (one cache entry
    for another is no gain); True (a pool at least half the GPU tier's size:
    `demotion.DISPLACING_POOL_FRACTION`) it does, least recently used first, but
    never a block of its own prefix.
    """
    copy = store.place(block, tier, ready=False)
    if copy is not None:
        return copy
    with store.victims(tier, droppable_only=True) as victims:
        while copy is None:
            victim = victims.next()
            if victim is None:
                return None
            if not victim.has_ready_copy_below(tier) and victim.ref_count == 0:
                if block.ref_count == 0 and (not displace_cache or is_ancestor(victim, block)):
                    # Stays: one cache entry for another is no gain; nor is a prefix's
                    # head for its own tail (the tail is found only through the head).
                    return None
                store.delete_block(victim)
                metrics.evictions_by_reason[f"{tier.value}_discard"] += 1
            else:
                store.drop_copy(victim, tier)
                metrics.evictions_by_reason[f"{tier.value}_drop"] += 1
            copy = store.place(block, tier, ready=False)
    return copy
