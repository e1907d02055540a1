"""Slot accounting for one tier: a fixed number of slots, a free list, an owner per slot.

The tier never decides anything; the store asks it for a free slot and gives
slots back. Full is the normal state of the CPU tier: the swapper makes room
by demoting or dropping cold copies, never by growing the tier.
"""

from __future__ import annotations

from kvswap.control.transfer import Tier


class TierSlots:
    """`num_slots` slots of one tier. O(1) allocate and release."""

    def __init__(self, tier: Tier, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"{tier.value} tier: num_slots must be >= 0, got {num_slots}")
        self.tier = tier
        self.num_slots = num_slots
        # Pop from the end: slot 0 is handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: list[int | None] = [None] * num_slots
        self.peak_used_slots = 0

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, block_id: int) -> int | None:
        """A free slot now owned by `block_id`, or None when the tier is full."""
        if not self._free:
            return None
        free = self._free
        slot = free.pop()
        self._owner[slot] = block_id
        used = self.num_slots - len(free)  # not the property: called for every copy placed
        if used > self.peak_used_slots:
            self.peak_used_slots = used
        return slot

    def release(self, slot: int, block_id: int) -> None:
        """Give `slot` back; it must be owned by `block_id` (two owners is a bug)."""
        owner = self._owner[slot]
        if owner != block_id:
            raise AssertionError(
                f"{self.tier.value} slot {slot} released by block {block_id} but owned by {owner}"
            )
        self._owner[slot] = None
        self._free.append(slot)

    def owner(self, slot: int) -> int | None:
        return self._owner[slot]

    def check_integrity(self) -> None:
        """Free slots have no owner, owned slots are not free, counts add up."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.tier.value}: a slot is free twice"
        for slot, owner in enumerate(self._owner):
            assert (owner is None) == (slot in free), (
                f"{self.tier.value} slot {slot}: owner {owner} but free={slot in free}"
            )
