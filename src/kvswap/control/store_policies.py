"""The store's side of the eviction policies: one per tier, what they hear, and the facts.

`BlockStore` owns one `TierPolicies` and reports every change of a block to
it; nothing else calls a policy. A tier's policy hears of a block only while
the block has a copy there, and only of changes that can alter the
`BlockFacts` of that copy:

    change                                  GPU policy        CPU policy
    a sequence starts / stops running       update (*)        -
    a reference taken                       update (*)        update
    a reference dropped, still referenced   update (*)        -
    the last reference dropped              update            update
    a copy placed being written, tier T     T: insert         T: insert
    a copy placed ready (a new block)       insert / update   insert / update
    a copy dropped from tier T              T: remove, the others: update
    a copy below goes stale in use          update            update
    transfers start / end (the mover)       update            update
    a GPU copy brought back from below      update (brought_back)
    a read by a step                        touch             touch

(*) only when a count crosses zero (`referenced`, `running`, `sink`): kvswap's
GPU policy ignores an update whose facts did not change, so the skips are
exact. Its CPU policy (the rank table for the tiers below the GPU) counts
every update as a use (its recency is the last change), so that tier hears
every change above except one: a copy placed on another tier while being
written, which its callers follow at once with the reservation of the source
(`BlockStore.reserve_source`: a re-rank, busy, not a candidate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import CPU_TIER, GPU_TIER, Tier
from kvswap.control.blocks import Block, Copy
from kvswap.control.policy import build_policy

#: The tiers with an eviction policy here: the slot tiers (a keyed tier evicts by its
#: own, and says what it evicted).
POLICY_TIERS = (Tier.GPU, Tier.CPU)
_POSITION = {tier: position for position, tier in enumerate(POLICY_TIERS)}
# BlockFacts is a NamedTuple: built from a tuple without its Python-level __new__,
# since the store makes one for every re-rank.
_new_facts = tuple.__new__


#: The facts of a block's GPU and CPU copies (None: no copy on that tier).
TierFacts = tuple[BlockFacts | None, BlockFacts | None]


def tier_facts(
    block: Block, brought_back: bool = False, skip: Tier | None = None, only: Tier | None = None
) -> TierFacts:
    """The facts of each of `block`'s copies on a slot tier, as that tier's policy
    sees it:

        tier   clean (a ready copy below)      ready_above
        GPU    CPU or a keyed tier              -
        CPU    a keyed tier                     GPU

    `brought_back`: the GPU copy just arrived from a slower tier. `skip` / `only`:
    no facts (None) for that tier / for the others, when the caller needs none.
    Written out in one body, no loops but over the block's few copies: a re-rank is
    the store's most frequent call, and each copy's readiness is read once for all
    tiers."""
    copies = block.copies
    gpu = copies.get(GPU_TIER)
    cpu = copies.get(CPU_TIER)
    if len(copies) == 1:  # most blocks: no other copy, so nothing clean or above
        on_gpu = on_cpu = below_cpu = False
    else:
        on_gpu = gpu is not None and gpu.ready and not gpu.stale
        on_cpu = cpu is not None and cpu.ready and not cpu.stale
        # A copy on a keyed tier (every tier but the two slot tiers is one, below both).
        below_cpu = len(copies) > (gpu is not None) + (cpu is not None) and (
            block.has_ready_copy_below(CPU_TIER)
        )
    referenced = block.ref_count > 0
    lost = block.lost
    key = block.key
    want_gpu = skip is not GPU_TIER and (only is None or only is GPU_TIER)
    want_cpu = skip is not CPU_TIER and (only is None or only is CPU_TIER)
    return (
        None if gpu is None or not want_gpu else _new_facts(BlockFacts, (
            referenced, block.num_running_refs > 0, block.num_protected_refs > 0,
            not gpu.ready or gpu.num_readers > 0, on_cpu or below_cpu,
            False, lost, brought_back, key,
        )),
        None if cpu is None or not want_cpu else _new_facts(BlockFacts, (
            referenced, False, False, not cpu.ready or cpu.num_readers > 0,
            below_cpu, on_gpu, lost, False, key,
        )),
    )  # fmt: skip


def facts_of(block: Block, tier: Tier) -> BlockFacts:
    """The facts of `block`'s copy on `tier` (a tier with a policy, where it has one)."""
    facts = tier_facts(block, only=tier)[_POSITION[tier]]
    assert facts is not None, f"block {block.block_id} has no {tier.value} copy"
    return facts


class TierPolicies:
    """The policies of the store's tiers, built by name (`PolicyOptions`)."""

    def __init__(
        self, options: PolicyOptions, blocks: Mapping[int, Block], num_slots: Mapping[Tier, int]
    ):
        self.by_tier: dict[Tier, EvictionPolicy] = {
            tier: build_policy(tier, options, capacity_blocks=num_slots[tier])
            for tier in POLICY_TIERS
        }
        self._gpu = self.by_tier[GPU_TIER]
        self._cpu = self.by_tier[CPU_TIER]
        self._blocks = blocks  # the store's: a forgotten block is nobody's to rank
        # Victims handed out by a `VictimRound` and not ranked on their tier since:
        # block id -> that tier. A change ranks the block again there and ends its loan;
        # the round ranks the rest again when it closes.
        self.loans: dict[int, Tier] = {}

    def changed(self, block: Block, *, gpu: bool = True) -> None:
        """Something about `block` changed; `gpu=False`: nothing its GPU copy's facts hold."""
        if block.copies and block.block_id in self._blocks:
            self._rerank(block, None if gpu else GPU_TIER)

    def _rerank(self, block: Block, skip: Tier | None, facts: TierFacts | None = None) -> None:
        """Every tier's policy but `skip`'s hears the facts of `block`'s copy there
        (`facts`: `tier_facts(block)`, when the caller has them)."""
        gpu, cpu = tier_facts(block, skip=skip) if facts is None else facts
        block_id = block.block_id
        if self.loans:
            loan = self.loans.get(block_id)
            if loan is not None and loan is not skip:
                del self.loans[block_id]  # its copy there is ranked again just below
        if gpu is not None and skip is not GPU_TIER:
            self._gpu.update(block_id, gpu)
        if cpu is not None and skip is not CPU_TIER:
            self._cpu.update(block_id, cpu)

    def changed_gpu(self, block: Block) -> None:
        """A change only a GPU copy's facts hold (`running`, `sink`)."""
        gpu = tier_facts(block, only=GPU_TIER)[0]
        if gpu is not None:
            self._rank_gpu(block.block_id, gpu)

    def placed(self, block: Block, tier: Tier, copy: Copy) -> None:
        """`copy` was placed on `tier`: that tier's policy inserts it. A copy placed
        ready (a new block's) may change what the copies on the other tiers are ranked
        by; one being written changes nothing they see (`clean` and `ready_above` count
        ready copies) until it arrives (`BlockStore.finish_transfer` re-ranks it then)."""
        tell_others = copy.ready and len(block.copies) > 1  # a new block's only copy: nobody
        facts = tier_facts(block) if tell_others else tier_facts(block, only=tier)
        policy = self.by_tier.get(tier)
        if policy is not None:
            placed = facts[_POSITION[tier]]
            assert placed is not None, "the copy was just placed"
            policy.insert(block.block_id, placed)
        if tell_others:
            self._rerank(block, tier, facts)

    def dropped(self, block: Block, tier: Tier) -> None:
        """`block`'s copy on `tier` is gone (the caller re-ranks the rest)."""
        policy = self.by_tier.get(tier)
        if policy is not None:
            policy.remove(block.block_id)
        self._end_loan(block.block_id, tier)

    def forget(self, block: Block) -> None:
        for policy in self.by_tier.values():
            policy.remove(block.block_id)
        if self.loans:
            self.loans.pop(block.block_id, None)

    def swapped_in(self, block: Block) -> None:
        gpu = tier_facts(block, brought_back=True, only=GPU_TIER)[0]
        if gpu is not None:
            self._rank_gpu(block.block_id, gpu)

    def _rank_gpu(self, block_id: int, facts: BlockFacts) -> None:
        self._gpu.update(block_id, facts)
        self._end_loan(block_id, GPU_TIER)

    def _end_loan(self, block_id: int, tier: Tier) -> None:
        """`block_id`'s copy on `tier` was ranked again or left: a loan there ends."""
        if self.loans and self.loans.get(block_id) is tier:
            del self.loans[block_id]

    def touch(self, keys: Iterable[BlockKey]) -> None:
        keys = list(keys)
        for policy in self.by_tier.values():
            policy.touch(keys)

    def advance(self, step: int) -> None:
        for policy in self.by_tier.values():
            policy.advance(step)

    def pop_victim(self, tier: Tier, *, droppable_only: bool) -> Block | None:
        """`tier`'s policy's next victim, checked against the hard rule (a `VictimRound`'s
        step: the round lends it)."""
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
            or (tier is GPU_TIER and block.num_running_refs > 0)
            # An unreferenced block is droppable whatever its other facts: no facts built.
            or (droppable_only and block.ref_count > 0 and not facts_of(block, tier).droppable)
        ):
            facts = facts_of(block, tier)
            raise RuntimeError(
                f"{type(policy).__name__}.evict(1) returned block {block.block_id}, whose "
                f"{tier.value} copy may not leave now ({facts})"
            )
        return block

    def check_integrity(self) -> None:
        assert not self.loans, f"victims of a round still unranked: {self.loans}"
        for tier, policy in self.by_tier.items():
            policy.check_integrity(
                {block_id for block_id, block in self._blocks.items() if tier in block.copies}
            )


class VictimRound:
    """One pass over a tier's victims, as its policy ranks them, closed by the store.

    `next()` hands out the next victim (it stops being ranked there: the next call
    offers another); `take(block)` makes a copy the caller chose itself (preemption's)
    a victim the same way. The caller then drops, moves or deletes the victim through
    the store, or leaves it be. Every store call that changes the copy ranks it again
    (a move reserves its source: ranked busy); when the round closes (`with`, or
    `close()`), the store ranks again each victim that no change reached and whose
    copy is still there. No caller returns or re-ranks a victim."""

    def __init__(self, policies: TierPolicies, tier: Tier, *, droppable_only: bool) -> None:
        self._policies = policies
        self.tier = tier
        self.droppable_only = droppable_only
        self._lent: list[Block] = []

    def next(self) -> Block | None:
        """The tier's next victim, or None when nothing (droppable, if asked) may leave."""
        block = self._policies.pop_victim(self.tier, droppable_only=self.droppable_only)
        if block is not None:
            self._lend(block)
        return block

    def take(self, block: Block) -> None:
        """`block`'s copy on the tier is a victim the caller chose (it must have one)."""
        self._policies.by_tier[self.tier].remove(block.block_id)
        self._lend(block)

    def _lend(self, block: Block) -> None:
        self._policies.loans[block.block_id] = self.tier
        self._lent.append(block)

    def close(self) -> None:
        loans = self._policies.loans
        for block in self._lent:
            if loans.get(block.block_id) is self.tier:
                del loans[block.block_id]
                if self.tier in block.copies:
                    self._policies.changed(block)
        self._lent.clear()

    def __enter__(self) -> VictimRound:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
