"""The tiers: where a copy of a block can live, each described once by its own facts.

The built-in ones are `Tier.GPU` and `Tier.CPU` (the pinned pool), the two tiers
of slots this process hands out, and below the pinned pool the keyed tiers:
`Tier.NVME` (the slab addressed by key, a tier of this process) where one is
configured, then `keyed_tier(i)`, the first of them `Tier.REMOTE`. Everything
the control plane treats differently per tier reads it off the tier; the
directions between tiers are `kvswap.base.transfer.Direction`.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar


class Addressing(enum.Enum):
    """How a tier's copies are found."""

    SLOTS = "slots"  # fixed slots this process hands out (GPU, pinned CPU)
    KEYS = "keys"  # by block key: the NVMe slab, a store shared between processes


@dataclass(frozen=True, eq=False, slots=True)
class Tier:
    """Where a copy of a block can live: a tier is what the control plane treats
    differently about it, described here once (its capacity comes with the store's
    layout, or the keyed tier's own). Tiers compare by identity; `Tier.GPU`,
    `Tier.CPU`, `Tier.NVME` and `Tier.REMOTE` are the built-in ones (`BUILT_IN_TIERS`).

        value          the tier's name, as metrics and summaries label it
        rank           its place in the order of speed, fastest (the GPU, 0) first:
                       a copy on a tier of higher rank is a copy below
        addressing     by slots this process hands out, or by block key
        checked_reads  a failed read means the copy itself is bad (a CRC or value
                       check failed, the key vanished), not only that transfer: the
                       copy is never read again
        local          in this process (memory or a slab it owns): a copy worth
                       remembering a block for; a block known only in a shared
                       store is found again by a lookup
        above          the tier a copy moves through to reach this one (None: the
                       GPU, where KV is computed): every direction moves a chunk
                       between a tier and the one above it
    """

    value: str
    rank: int
    addressing: Addressing
    checked_reads: bool
    local: bool
    above: Tier | None
    keyed: bool = field(init=False)  # addressed by key (read per copy placed: a field)

    GPU: ClassVar[Tier]
    CPU: ClassVar[Tier]
    NVME: ClassVar[Tier]
    REMOTE: ClassVar[Tier]

    def __post_init__(self) -> None:
        object.__setattr__(self, "keyed", self.addressing is Addressing.KEYS)

    def __repr__(self) -> str:
        return f"Tier({self.value!r})"


_SLOTS, _KEYS = Addressing.SLOTS, Addressing.KEYS
Tier.GPU = Tier("gpu", 0, _SLOTS, checked_reads=False, local=True, above=None)
Tier.CPU = Tier("cpu", 1, _SLOTS, checked_reads=False, local=True, above=Tier.GPU)
# The NVMe slab addressed by key (`kvswap.data.tiers.nvme_tier`): a keyed tier of
# this process, evicting by its own policy and saying what it evicted; always the
# first keyed tier.
Tier.NVME = Tier("nvme", 2, _KEYS, checked_reads=True, local=True, above=Tier.CPU)
# A store shared between processes (the Redis protocol), addressed by block key.
Tier.REMOTE = Tier("remote", 3, _KEYS, checked_reads=True, local=False, above=Tier.CPU)
#: A tier's rank: the key that orders tiers fastest first.
tier_rank = operator.attrgetter("rank")
#: The built-in tiers, fastest first.
BUILT_IN_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.NVME, Tier.REMOTE)
#: The built-in tiers whose copies take a slot of this process (each has a `TierSlots`).
SLOT_TIERS: tuple[Tier, ...] = tuple(t for t in BUILT_IN_TIERS if t.addressing is _SLOTS)
_KEYED_TIERS: list[Tier] = [Tier.REMOTE]


def keyed_tier(position: int) -> Tier:
    """The tier at `position` (0 first) of the list of keyed tiers below the pinned
    pool that are not of this process, fastest first: `Tier.REMOTE` (the list's first,
    the shared store when one is configured), then "remote2", "remote3", ... Made once
    for each position: every store of the process names the same tier by the same
    object. (A tier of this process in front of them is `Tier.NVME`.)"""
    if position < 0:
        raise ValueError(f"a keyed tier's position is >= 0, got {position}")
    while len(_KEYED_TIERS) <= position:
        name = f"remote{len(_KEYED_TIERS) + 1}"
        rank = Tier.REMOTE.rank + len(_KEYED_TIERS)
        _KEYED_TIERS.append(Tier(name, rank, _KEYS, checked_reads=True, local=False,
                                 above=Tier.CPU))  # fmt: skip
    return _KEYED_TIERS[position]


def keyed_tier_list(local: Sequence[bool]) -> tuple[Tier, ...]:
    """The tiers of a list of keyed tiers below the pinned pool, fastest first, where
    `local[i]` says whether the i-th is this process's own (`RemoteIndex.local`): that
    one is `Tier.NVME`, the others `keyed_tier(0)`, `keyed_tier(1)`, ... in order.
    ValueError unless at most one is local, and it comes first."""
    positions = [position for position, own in enumerate(local) if own]
    if positions not in ([], [0]):
        raise ValueError(
            f"a keyed tier of this process (the NVMe slab by key) at positions {positions} "
            "of the keyed tiers; allowed: at most one, first in the list"
        )
    others = iter([keyed_tier(position) for position in range(len(local) - len(positions))])
    return tuple(Tier.NVME if own else next(others) for own in local)


# The tiers as module constants, for code that runs per block: a global read is
# cheaper than a class attribute's.
GPU_TIER, CPU_TIER = Tier.GPU, Tier.CPU


def reported_tiers(keyed: tuple[Tier, ...]) -> tuple[Tier, ...]:
    """The tiers a report lists, fastest first, where `keyed` are the keyed tiers in
    use: the built-in ones, then the other keyed tiers (remote2, ...)."""
    return BUILT_IN_TIERS + tuple(tier for tier in keyed if tier not in BUILT_IN_TIERS)
