"""Slot accounting for one tier: a fixed number of slots, a free list, an owner per slot.

The tier never decides anything; the store asks it for a free slot and gives
slots back. Full is the normal state of the CPU tier: the swapper makes room
by demoting or dropping cold copies, never by growing the tier.
"""

from __future__ import annotations

from kvswap.base.tier import Tier


class TierSlots:
    """`num_slots` slots of one tier. O(1) allocate and release, and O(slots in use)
    memory: a tier sized from a large card may hold tens of millions of slots (a
    tiny model with 1-token blocks), of which a run touches few."""

    def __init__(self, tier: Tier, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"{tier.value} tier: num_slots must be >= 0, got {num_slots}")
        self.tier = tier
        self.num_slots = num_slots
        # Slots never handed out are [_next_fresh, num_slots), given lowest first;
        # released ones wait in `_released` and go first, the last released first.
        # (The same order as one free list of every slot, filled descending.)
        self._next_fresh = 0
        self._released: list[int] = []
        self._owner: dict[int, int] = {}  # slot -> block id, slots in use only
        self.peak_used_slots = 0

    @property
    def num_used_slots(self) -> int:
        return len(self._owner)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - len(self._owner)

    def allocate(self, block_id: int) -> int | None:
        """A free slot now owned by `block_id`, or None when the tier is full."""
        if self._released:
            slot = self._released.pop()
        elif self._next_fresh < self.num_slots:
            slot = self._next_fresh
            self._next_fresh += 1
        else:
            return None
        owner = self._owner
        owner[slot] = block_id
        used = len(owner)  # not the property: called for every copy placed
        if used > self.peak_used_slots:
            self.peak_used_slots = used
        return slot

    def release(self, slot: int, block_id: int) -> None:
        """Give `slot` back; it must be owned by `block_id` (two owners is a bug)."""
        owner = self._owner.get(slot)
        if owner != block_id:
            raise AssertionError(
                f"{self.tier.value} slot {slot} released by block {block_id} but owned by {owner}"
            )
        del self._owner[slot]
        self._released.append(slot)

    def owner(self, slot: int) -> int | None:
        return self._owner.get(slot)

    def check_integrity(self) -> None:
        """Free slots have no owner, owned slots are not free, counts add up."""
        released = set(self._released)
        assert len(released) == len(self._released), f"{self.tier.value}: a slot is free twice"
        for slot in released:
            assert 0 <= slot < self._next_fresh, f"{self.tier.value}: slot {slot} released unused"
            assert slot not in self._owner, f"{self.tier.value} slot {slot}: owned and free"
        for slot in self._owner:
            assert 0 <= slot < self._next_fresh, f"{self.tier.value}: slot {slot} owned unused"
        assert len(self._owner) + len(released) == self._next_fresh, (
            f"{self.tier.value}: {self._next_fresh} slots handed out, "
            f"{len(self._owner)} owned + {len(released)} free"
        )
