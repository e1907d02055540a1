"""Demotion: past a tier's high watermark its coldest copies move to the tiers below.

One demoter walks the tiers addressed by slots, fastest first, each with what
lies below it (`tier_pairs`):

    GPU -> CPU          swap_out_high_watermark .. swap_out_low_watermark    (swap-out)
    CPU -> keyed tiers  cpu_demote_high_watermark .. cpu_demote_low_watermark (demotion)

Cheap directions first, ahead of need and on the LOW queue: nobody waits for
them. A pass takes the upper tier's victims from the store (`store.victims`,
as its policy ranks them) until the tier is back under its low watermark, and
each victim meets the same rule (`Demoter.move_down`):

    a ready copy further down     -> the upper copy is dropped, free  (`{reason}_drop`);
                                     when only the shared store holds it, the tier
                                     below takes it first if it has room; a faster
                                     keyed tier written on demotion that lacks it and
                                     has no room for writes now: it stays, and the
                                     pass stops (as for a full tier below)
    a copy below still in flight  -> stays for a later pass
    room below (`room.make_room`) -> copied down; the upper copy is freed when it
                                     lands (`{reason}_swap_out`: only the GPU's
                                     victims have a slot tier below)
    no room below                 -> the pair decides (`TierPair.discard_when_full`):
                                     the GPU discards an unreferenced victim (a cache
                                     entry nobody needs; `{reason}_discard`) and keeps
                                     a referenced one; the pinned pool keeps it and
                                     the pass stops

A GPU pass pops at most the tier's excess, victims that stay included (bounded
work while the pinned pool is full); a pinned-pool pass looks past a victim
that stays, since the next one may still leave for free (`TierPair.stayers_count`).

The pinned pool makes room for the GPU's victims as its own policy ranks it
(`make_room`): it takes a newer cache entry in place of an older one when it
holds at least half the GPU tier's blocks (`DISPLACING_POOL_FRACTION`; a
smaller pool keeps what it holds); the only copy of a referenced block never
leaves.

Below the pinned pool every tier is keyed (the NVMe slab by key, the shared
store, ...), each evicting by its own policy. With keyed tiers written
`on_demote`, every block the pinned pool (`Tier.above` of a keyed tier) lets go
is written to each of them first, unless it has it, then dropped (instead of a
free drop: the CPU copy goes once every write succeeded). Once their room for
writes in flight is used up, nothing below has room and the pass stops (each
write that lands makes room for the next pass).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvswap.base.tier import Tier
from kvswap.base.transfer import Priority, direction_between
from kvswap.control.blocks import Block, Copy
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import Mover
from kvswap.control.remote_tier import RemoteTier
from kvswap.control.room import make_room
from kvswap.control.settings import SwapSettings
from kvswap.control.store import BlockStore


@dataclass(frozen=True)
class TierPair:
    """A slot tier and what lies below it: past `upper`'s high watermark its coldest
    copies go to `lower` (the slot tier below), or to the keyed tiers below it (`lower`
    None: the pinned pool, whose victims are written to them)."""

    upper: Tier
    lower: Tier | None
    high_watermark: float  # fractions of the upper tier's slots
    low_watermark: float
    reason: str  # the metric label of a watermark pass ("watermark", "demote")
    # An unreferenced victim may displace an unreferenced copy on `lower` (a cache
    # entry for an older one: `make_room`).
    displace_cache: bool
    # No room below: an unreferenced victim is discarded, a referenced one stays and
    # the pass goes on (the tier above must make room); else the pass stops there.
    discard_when_full: bool
    # A victim that stays counts towards the low watermark: the pass pops at most the
    # tier's excess (the GPU: bounded work while the tier below is full). Else the
    # pass looks past it (the pinned pool: the next one may still leave for free).
    stayers_count: bool


#: The pinned pool takes the GPU's victims in place of its older cache entries only
#: when it holds at least this fraction of the GPU tier's blocks. A smaller pool would
#: hold nothing but the GPU's latest victims, churned through before they are asked
#: for again; keeping its older entries serves more there. Measured (the simulator,
#: policy_curve's CHAT, a GPU tier of 1,024 blocks, nothing below the pool): pools of
#: 128 / 256 blocks 0.97x / 0.99x the prefix hits of never displacing, 512 1.03x,
#: 1,024 1.11x, 2,048 1.22x, 4,096 1.35x.
DISPLACING_POOL_FRACTION = 0.5


def tier_pairs(settings: SwapSettings, num_slots: Mapping[Tier, int]) -> tuple[TierPair, ...]:
    """The slot tiers' passes, fastest first, with their watermarks (`num_slots`: each
    tier's size, which decides whether the pinned pool displaces): the GPU's into the
    pinned pool, then the pinned pool's into the keyed tiers below it."""
    displaces = num_slots[Tier.CPU] >= DISPLACING_POOL_FRACTION * num_slots[Tier.GPU]
    return (
        TierPair(
            Tier.GPU, Tier.CPU, settings.swap_out_high_watermark, settings.swap_out_low_watermark,
            reason="watermark", displace_cache=displaces,
            discard_when_full=True, stayers_count=True,
        ),
        TierPair(
            Tier.CPU, None, settings.cpu_demote_high_watermark, settings.cpu_demote_low_watermark,
            reason="demote", displace_cache=False,
            discard_when_full=False, stayers_count=False,
        ),
    )  # fmt: skip


class _Outcome(enum.Enum):
    LEFT = "left"  # dropped, discarded, or on its way down (or to the remote store)
    STAYS = "stays"  # ranked again when the pass's round closes
    STOP = "stop"  # stays, and the pass ends: nothing below has room


class Demoter:
    def __init__(
        self,
        store: BlockStore,
        mover: Mover,
        metrics: KVMetrics,
        settings: SwapSettings,
        remotes: Sequence[RemoteTier] = (),
    ):
        self.store = store
        self.mover = mover
        self.metrics = metrics
        self.pairs = tier_pairs(
            settings, {tier: slots.num_slots for tier, slots in store.tiers.items()}
        )
        self.pair_below = {pair.upper: pair for pair in self.pairs}
        self.remotes = tuple(remotes)

    def demote_past_watermarks(self) -> None:
        """One pass per pair, fastest first (what the GPU lets go may push the pinned
        pool past its own watermark in the same step)."""
        for pair in self.pairs:
            self._pass(pair)

    def move_down(
        self, pair: TierPair, victims: Iterable[Block], *, reason: str, priority: Priority
    ) -> None:
        """Apply the rule to victims the caller chose (synchronous eviction, preemption):
        each leaves, or stays ranked on its tier. A victim whose copy an earlier one's
        room below took away (discarded as a cache entry there, every copy of it) is
        passed over: it has left already."""
        moves: list[tuple[Block, Copy]] = []
        with self.store.victims(pair.upper) as chosen:
            for block in victims:
                if block.lost or pair.upper not in block.copies:
                    continue
                chosen.take(block)
                self._place(pair, block, reason, moves, ())
        self._submit_moves(pair, priority, moves)

    def make_room_now(self, tier: Tier, num_blocks: int) -> None:
        """Start moving `tier`'s coldest copies down now (HIGH queue), until `num_blocks`
        of its slots will be free once they land: for a caller whose one step pushes
        more through the pinned pool than it holds (a layer-wise cache), where the
        watermark pass of `end_step` comes too late. The same rule as every pass."""
        pair = self.pair_below.get(tier)
        if pair is not None:
            slots = self.store.tiers[tier]
            self._pass(pair, target=slots.num_slots - num_blocks, priority=Priority.HIGH)

    # ------------------------------------------------------------------ internal

    def _pass(
        self, pair: TierPair, *, target: float | None = None, priority: Priority = Priority.LOW
    ) -> None:
        """Pop `pair.upper`'s victims until its used slots are down to `target` (None:
        past the high watermark, down to the low one)."""
        upper = self.store.tiers[pair.upper]
        writes = self._remote_writes(pair)
        no_room_below = self._slots_below(pair) == 0 and not writes
        if upper.num_slots == 0 or (no_room_below and not pair.discard_when_full):
            return  # nothing could leave but by a discard, which this pair never makes
        used = upper.num_used_slots - self._leaving(pair.upper)
        if target is None:
            if used < pair.high_watermark * upper.num_slots:
                return
            target = pair.low_watermark * upper.num_slots
        moves: list[tuple[Block, Copy]] = []
        with self.store.victims(pair.upper) as victims:  # those that stay are ranked again
            while used > target:
                victim = victims.next()
                if victim is None:
                    break
                outcome = self._place(pair, victim, pair.reason, moves, writes)
                if outcome is _Outcome.STOP:
                    break
                if outcome is _Outcome.LEFT or pair.stayers_count:
                    used -= 1
        self._submit_moves(pair, priority, moves)
        for tier_writes in writes:
            # With evict every way: the copy is freed by whichever lands last, successfully.
            tier_writes.remote.submit_writes(tier_writes.planned, evict=True, priority=priority)

    def _place(
        self,
        pair: TierPair,
        block: Block,
        reason: str,
        moves: list[tuple[Block, Copy]],
        writes: Sequence[_Writes],
    ) -> _Outcome:
        """One victim of `pair.upper`: where it goes (`moves`, `writes`), or that it stays."""
        written = False
        for tier_writes in writes:  # each keyed tier that lacks it, not only the first
            written = tier_writes.plan(block) or written
        if written:
            self.metrics.evictions_by_reason[f"{reason}_remote"] += 1
        if block.has_ready_copy_below(pair.upper):
            if written:
                return _Outcome.LEFT  # the copy goes once the write succeeded
            if _waits_for_faster_tier(block, pair.upper, writes):
                # A faster keyed tier written on demotion lacks it and has no room for
                # writes now: it stays for that tier, as it stays for a full slot tier.
                return _Outcome.STOP
            # Only the shared store holds it: the tier below takes it first when it has
            # room (the store evicts by its own rules, and reads slower).
            local = block.has_ready_copy_below(pair.upper, local=True)
            if not local and self._move(pair, block, reason, moves):
                return _Outcome.LEFT
            self.store.drop_copy(block, pair.upper)
            self.metrics.evictions_by_reason[f"{reason}_drop"] += 1
            return _Outcome.LEFT
        no_tier_below = bool(writes) and self._slots_below(pair) == 0
        if pair.lower in block.copies or no_tier_below:
            # A copy below still in flight (a stale one still read, an older one still
            # written): the block gets no second copy there and stays until it lands.
            # With no tier below but the store, the write is the way down; once the
            # store's room for writes in flight is used up, nothing below has room
            # (looking past every victim of the tier would only rank them all again).
            if written:
                return _Outcome.LEFT
            if not no_tier_below or any(tier_writes.room_blocks > 0 for tier_writes in writes):
                return _Outcome.STAYS
        elif self._move(pair, block, reason, moves):
            return _Outcome.LEFT
        if not pair.discard_when_full:
            return _Outcome.STOP
        if block.ref_count == 0:
            self.store.delete_block(block)  # a cache entry with nowhere to go
            self.metrics.evictions_by_reason[f"{reason}_discard"] += 1
            return _Outcome.LEFT
        return _Outcome.STAYS  # nowhere below has room

    def _move(
        self, pair: TierPair, block: Block, reason: str, moves: list[tuple[Block, Copy]]
    ) -> bool:
        """Whether `block` is copied down to `pair.lower` (planned in `moves`): False
        when there is no such tier, it has a copy of it, or neither has nor makes room."""
        if pair.lower is None or pair.lower in block.copies or self._slots_below(pair) == 0:
            return False
        copy = make_room(
            self.store, self.metrics, pair.lower, block, displace_cache=pair.displace_cache
        )
        if copy is None:
            return False
        moves.append(self.mover.reserve(block, pair.upper, copy))
        self.metrics.evictions_by_reason[f"{reason}_swap_out"] += 1  # into the pinned pool
        return True

    def _slots_below(self, pair: TierPair) -> int:
        """The slots of the slot tier below `pair.upper` (0: none)."""
        return 0 if pair.lower is None else self.store.tiers[pair.lower].num_slots

    def _submit_moves(
        self, pair: TierPair, priority: Priority, moves: list[tuple[Block, Copy]]
    ) -> None:
        """Copy the moves planned into the slot tier below (none without one)."""
        if pair.lower is not None:
            direction = direction_between(pair.upper, pair.lower)
            self.mover.submit(direction, priority, moves, evict=True)

    def _leaving(self, tier: Tier) -> int:
        """Copies of `tier` not counted as used: the GPU's evictions in flight (freed when
        they land). The pinned pool counts its demotions in flight as used until then."""
        return self.mover.num_gpu_evictions_pending if tier is Tier.GPU else 0

    def _remote_writes(self, pair: TierPair) -> list[_Writes]:
        """The writes a pass out of `pair.upper` makes: to each keyed tier written on
        demotion that sits below that tier."""
        return [
            _Writes(remote, remote.write_room_blocks())
            for remote in self.remotes
            if remote.demotes and remote.tier.above is pair.upper
        ]


def _waits_for_faster_tier(block: Block, upper: Tier, writes: Sequence[_Writes]) -> bool:
    """Whether a keyed tier of `writes` lacks `block`, has no room for writes now, and
    is faster than every tier below `upper` with a ready copy of it (say the NVMe slab
    by key, in front of a shared store that has the block)."""
    waiting = [w.remote.tier.rank for w in writes
               if w.room_blocks <= 0 and w.remote.tier not in block.copies]  # fmt: skip
    if not waiting:
        return False
    fastest = min(
        (tier.rank for tier, copy in block.copies.items()
         if tier.rank > upper.rank and copy.ready and not copy.stale),
        default=None,
    )  # fmt: skip
    return fastest is not None and min(waiting) < fastest


class _Writes:
    """A pass's writes to one keyed tier, bounded by its room for writes in flight."""

    def __init__(self, remote: RemoteTier, room_blocks: int):
        self.remote = remote
        self.room_blocks = room_blocks
        self.planned: list[tuple[Block, Copy]] = []

    def plan(self, block: Block) -> bool:
        """Plan `block`'s write if there is room and the tier lacks it; True if planned."""
        if self.room_blocks <= 0:
            return False
        write = self.remote.plan_write(block)
        if write is None:
            return False
        self.room_blocks -= 1
        self.planned.append(write)
        return True
