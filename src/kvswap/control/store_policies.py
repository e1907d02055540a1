"""The store's side of the eviction policies: one per tier, what they hear, and the facts.

`BlockStore` owns one `TierPolicies` and reports every change of a block to
it; nothing else calls a policy. A tier's policy hears of a block only while
the block has a copy there, and only of changes that can alter the
`BlockFacts` of that copy:

    change                                  GPU policy        CPU, NVMe policies
    a sequence starts / stops running       update (*)        -
    a reference taken                       update (*)        update
    a reference dropped, still referenced   update (*)        -
    the last reference dropped              update            update
    a copy placed being written, tier T     T: insert         T: insert
    a copy placed ready (a new block)       insert / update   insert / update
    a copy dropped from tier T              T: remove, the others: update
    transfers start / end (the mover)       update            update
    a GPU copy brought back from below      update (brought_back)
    a read by a step                        touch             touch

(*) only when a count crosses zero (`referenced`, `running`, `sink`): kvswap's
GPU policy ignores an update whose facts did not change, so the skips are
exact. Its CPU and NVMe policy (one rank table for the tiers below the GPU)
counts every update as a use (its recency is the last change), so those tiers
hear every change above except one: a copy placed on another tier while being
written, which its callers follow at once with the reservation of the source
(`BlockStore.reserve_source`: a re-rank, busy, not a candidate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvswap.control.blocks import Block, Copy
from kvswap.control.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.control.policy import build_policy
from kvswap.control.transfer import Tier

#: The tiers with an eviction policy (remote copies take no slot here: nothing to evict).
POLICY_TIERS = (Tier.GPU, Tier.CPU, Tier.NVME)
# Module constants: an Enum member read off its class costs ~0.2 us in Python 3.11,
# several times per re-rank.
_GPU, _CPU, _NVME, _REMOTE = Tier.GPU, Tier.CPU, Tier.NVME, Tier.REMOTE
# BlockFacts is a NamedTuple: built from a tuple without its Python-level __new__,
# since the store makes one for every re-rank.
_new_facts = tuple.__new__


# The builders the store calls for every re-rank are written out tier by tier
# (no loops, no calls): they are most of what a re-rank costs.


def gpu_facts(block: Block, copy: Copy, brought_back: bool = False) -> BlockFacts:
    """The facts of `block`'s GPU copy `copy`."""
    copies = block.copies
    clean = False
    if len(copies) > 1:  # most GPU blocks have no other copy
        below = copies.get(_CPU)
        if below is None or not below.ready or below.stale:
            below = copies.get(_NVME)
            if below is None or not below.ready or below.stale:
                below = copies.get(_REMOTE)
        clean = below is not None and below.ready and not below.stale
    return _new_facts(BlockFacts, (
        block.ref_count > 0, block.num_running_refs > 0, block.num_protected_refs > 0,
        not copy.ready or copy.num_readers > 0, clean, False, block.lost, brought_back,
        block.key,
    ))  # fmt: skip


def cpu_facts(block: Block, copy: Copy) -> BlockFacts:
    """The facts of `block`'s CPU copy `copy` (no `running`, `sink`: GPU facts)."""
    copies = block.copies
    clean = above = False
    if len(copies) > 1:
        below = copies.get(_NVME)
        if below is None or not below.ready or below.stale:
            below = copies.get(_REMOTE)
        clean = below is not None and below.ready and not below.stale
        gpu = copies.get(_GPU)
        above = gpu is not None and gpu.ready and not gpu.stale
    return _new_facts(BlockFacts, (
        block.ref_count > 0, False, False, not copy.ready or copy.num_readers > 0,
        clean, above, block.lost, False, block.key,
    ))  # fmt: skip


def nvme_facts(block: Block, copy: Copy) -> BlockFacts:
    """The facts of `block`'s NVMe copy `copy`: `clean` is a ready remote copy,
    `ready_above` a ready CPU or GPU copy."""
    copies = block.copies
    clean = above = False
    if len(copies) > 1:
        remote = copies.get(_REMOTE)
        clean = remote is not None and remote.ready and not remote.stale
        up = copies.get(_CPU)
        if up is None or not up.ready or up.stale:
            up = copies.get(_GPU)
        above = up is not None and up.ready and not up.stale
    return _new_facts(BlockFacts, (
        block.ref_count > 0, False, False, not copy.ready or copy.num_readers > 0,
        clean, above, block.lost, False, block.key,
    ))  # fmt: skip


def facts_of(block: Block, tier: Tier, copy: Copy) -> BlockFacts:
    """The facts of `block`'s copy `copy` on `tier` (a tier with a policy)."""
    if tier is _GPU:
        return gpu_facts(block, copy)
    return cpu_facts(block, copy) if tier is _CPU else nvme_facts(block, copy)


class TierPolicies:
    """The policies of the store's tiers, built by name (`PolicyOptions`)."""

    def __init__(self, options: PolicyOptions, blocks: Mapping[int, Block]):
        self.by_tier: dict[Tier, EvictionPolicy] = {
            tier: build_policy(tier, options) for tier in POLICY_TIERS
        }
        self._gpu = self.by_tier[_GPU]
        self._cpu = self.by_tier[_CPU]
        self._nvme = self.by_tier[_NVME]
        self._blocks = blocks  # the store's: a forgotten block is nobody's to rank

    def changed(self, block: Block, *, gpu: bool = True) -> None:
        """Something about `block` changed; `gpu=False`: nothing its GPU copy's facts hold."""
        if block.copies and block.block_id in self._blocks:
            self._rerank(block, None if gpu else _GPU)

    def _rerank(self, block: Block, skip: Tier | None) -> None:
        """Every tier's policy but `skip`'s hears the facts of `block`'s copy there.

        The three builders written out in one body: a re-rank is the store's most
        frequent call, and the readiness of each copy is read once for all tiers."""
        copies = block.copies
        gpu = copies.get(_GPU)
        cpu = copies.get(_CPU)
        nvme = copies.get(_NVME)
        if len(copies) == 1:  # most blocks: no other copy, so nothing clean or above
            on_gpu = on_cpu = on_nvme = on_remote = False
        else:
            remote = copies.get(_REMOTE)
            on_gpu = gpu is not None and gpu.ready and not gpu.stale
            on_cpu = cpu is not None and cpu.ready and not cpu.stale
            on_nvme = nvme is not None and nvme.ready and not nvme.stale
            on_remote = remote is not None and remote.ready and not remote.stale
        referenced = block.ref_count > 0
        lost = block.lost
        key = block.key
        block_id = block.block_id
        if gpu is not None and skip is not _GPU:
            self._gpu.update(block_id, _new_facts(BlockFacts, (
                referenced, block.num_running_refs > 0, block.num_protected_refs > 0,
                not gpu.ready or gpu.num_readers > 0, on_cpu or on_nvme or on_remote,
                False, lost, False, key,
            )))  # fmt: skip
        if cpu is not None and skip is not _CPU:
            self._cpu.update(block_id, _new_facts(BlockFacts, (
                referenced, False, False, not cpu.ready or cpu.num_readers > 0,
                on_nvme or on_remote, on_gpu, lost, False, key,
            )))  # fmt: skip
        if nvme is not None and skip is not _NVME:
            self._nvme.update(block_id, _new_facts(BlockFacts, (
                referenced, False, False, not nvme.ready or nvme.num_readers > 0,
                on_remote, on_cpu or on_gpu, lost, False, key,
            )))  # fmt: skip

    def changed_gpu(self, block: Block) -> None:
        """A change only a GPU copy's facts hold (`running`, `sink`)."""
        copy = block.copies.get(_GPU)
        if copy is not None:
            self._gpu.update(block.block_id, gpu_facts(block, copy))

    def placed(self, block: Block, tier: Tier, copy: Copy) -> None:
        """`copy` was placed on `tier`: that tier's policy inserts it. A copy placed
        ready (a new block's) may change what the copies on the other tiers are ranked
        by; one being written changes nothing they see (`clean` and `ready_above` count
        ready copies) until it arrives (`BlockStore.finish_transfer` re-ranks it then)."""
        if tier is _GPU:
            self._gpu.insert(block.block_id, gpu_facts(block, copy))
        elif tier is _CPU:
            self._cpu.insert(block.block_id, cpu_facts(block, copy))
        elif tier is _NVME:
            self._nvme.insert(block.block_id, nvme_facts(block, copy))
        if copy.ready and len(block.copies) > 1:  # a new block's only copy: nobody else to tell
            self._rerank(block, tier)

    def dropped(self, block: Block, tier: Tier) -> None:
        """`block`'s copy on `tier` is gone (the caller re-ranks the rest)."""
        policy = self.by_tier.get(tier)
        if policy is not None:
            policy.remove(block.block_id)

    def forget(self, block: Block) -> None:
        for policy in self.by_tier.values():
            policy.remove(block.block_id)

    def swapped_in(self, block: Block) -> None:
        copy = block.copies.get(_GPU)
        if copy is not None:
            self._gpu.update(block.block_id, gpu_facts(block, copy, brought_back=True))

    def touch(self, keys: Iterable[BlockKey]) -> None:
        keys = list(keys)
        for policy in self.by_tier.values():
            policy.touch(keys)

    def advance(self, step: int) -> None:
        for policy in self.by_tier.values():
            policy.advance(step)

    def pop_victim(self, tier: Tier, *, droppable_only: bool) -> Block | None:
        """`tier`'s policy's next victim, checked against the hard rule."""
        policy = self.by_tier[tier]
        keys = policy.evict(1, droppable_only=droppable_only)
        if keys is None:
            return None
        key = keys[0] if len(keys) == 1 else None
        block = self._blocks.get(key) if isinstance(key, int) else None
        copy = block.copies.get(tier) if block is not None else None
        if block is None or copy is None:
            raise RuntimeError(f"{type(policy).__name__}.evict(1) returned {keys!r}: no copy")
        if (
            copy.is_busy
            or block.lost
            or (tier is _GPU and block.num_running_refs > 0)
            # An unreferenced block is droppable whatever its other facts: no facts built.
            or (
                droppable_only and block.ref_count > 0 and not facts_of(block, tier, copy).droppable
            )
        ):
            facts = facts_of(block, tier, copy)
            raise RuntimeError(
                f"{type(policy).__name__}.evict(1) returned block {block.block_id}, whose "
                f"{tier.value} copy may not leave now ({facts})"
            )
        return block

    def check_integrity(self) -> None:
        for tier, policy in self.by_tier.items():
            policy.check_integrity(
                {block_id for block_id, block in self._blocks.items() if tier in block.copies}
            )
