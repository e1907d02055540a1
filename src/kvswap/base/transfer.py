"""Tiers and transfers as the control plane sees them: ids, slots, directions, priorities.

The control plane never touches bytes. It hands a `TransferChunk` to a
`CopyEngine` (the real one in `kvswap.data.copy_engine`, a modelled one in the
simulator) and later learns, by polling, that the chunk finished.

Lifecycle, for every chunk:

    swapper --submit(chunk)--> copy engine      (slots pinned by the swapper)
    swapper <--poll()-------- [TransferResult]  (slots released by the swapper)

Nothing is "probably done": a slot that a chunk reads or writes stays reserved
until its `TransferResult` has been polled.
"""

from __future__ import annotations

import enum
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


class Addressing(enum.Enum):
    """How a tier's copies are found."""

    SLOTS = "slots"  # fixed slots this process hands out (GPU, pinned CPU, NVMe slab)
    KEYS = "keys"  # by block key, in a store shared between processes (no slots here)


@dataclass(frozen=True, eq=False, slots=True)
class Tier:
    """Where a copy of a block can live: a tier is what the control plane treats
    differently about it, described here once (its capacity comes with the store's
    layout). Tiers compare by identity; `Tier.GPU`, `Tier.CPU`, `Tier.NVME` and
    `Tier.REMOTE` are the built-in ones (`BUILT_IN_TIERS`).

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
Tier.NVME = Tier("nvme", 2, _SLOTS, checked_reads=True, local=True, above=Tier.CPU)
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
    pool, fastest first: `Tier.REMOTE` (the list's first, the shared store when one is
    configured), then "remote2", "remote3", ... Made once for each position: every
    store of the process names the same tier by the same object."""
    if position < 0:
        raise ValueError(f"a keyed tier's position is >= 0, got {position}")
    while len(_KEYED_TIERS) <= position:
        name = f"remote{len(_KEYED_TIERS) + 1}"
        rank = Tier.REMOTE.rank + len(_KEYED_TIERS)
        _KEYED_TIERS.append(Tier(name, rank, _KEYS, checked_reads=True, local=False,
                                 above=Tier.CPU))  # fmt: skip
    return _KEYED_TIERS[position]


@dataclass(frozen=True, eq=False, slots=True)
class Direction:
    """Which way a chunk moves: between a tier and the one above it (`Tier.above`),
    one way or the other. One object per pair of tiers (`direction_between` makes
    and keeps it), compared by identity; `Direction.GPU_TO_CPU` and the others
    between built-in tiers are `BUILT_IN_DIRECTIONS`.

        value    the metric label: "<src>_to_<dst>" ("cpu_to_nvme")
        upward   towards the GPU (a swap-in or its first hop): what a step may wait for
        keyed    one side is addressed by key: that side is addressed by the chunk's
                 `keys` (its slots are the positions 0..n-1 of `keys`)
    """

    src_tier: Tier
    dst_tier: Tier
    value: str = field(init=False)
    upward: bool = field(init=False)
    keyed: bool = field(init=False)

    GPU_TO_CPU: ClassVar[Direction]
    CPU_TO_GPU: ClassVar[Direction]
    CPU_TO_NVME: ClassVar[Direction]
    NVME_TO_CPU: ClassVar[Direction]
    CPU_TO_REMOTE: ClassVar[Direction]
    REMOTE_TO_CPU: ClassVar[Direction]

    def __post_init__(self) -> None:
        src, dst = self.src_tier, self.dst_tier
        if src.above is not dst and dst.above is not src:
            raise ValueError(f"no direction from {src.value} to {dst.value}: tiers not adjacent")
        object.__setattr__(self, "value", f"{src.value}_to_{dst.value}")
        object.__setattr__(self, "upward", src.above is dst)
        object.__setattr__(self, "keyed", src.keyed or dst.keyed)

    def __repr__(self) -> str:
        return f"Direction({self.value!r})"


_DIRECTIONS: dict[tuple[Tier, Tier], Direction] = {}


def direction_between(src: Tier, dst: Tier) -> Direction:
    """The direction a chunk from `src` to `dst` moves (adjacent tiers only: ValueError
    otherwise); the same object for the same pair of tiers."""
    direction = _DIRECTIONS.get((src, dst))
    if direction is None:
        direction = _DIRECTIONS[(src, dst)] = Direction(src, dst)
    return direction


Direction.GPU_TO_CPU = direction_between(Tier.GPU, Tier.CPU)
Direction.CPU_TO_GPU = direction_between(Tier.CPU, Tier.GPU)
Direction.CPU_TO_NVME = direction_between(Tier.CPU, Tier.NVME)
Direction.NVME_TO_CPU = direction_between(Tier.NVME, Tier.CPU)
Direction.CPU_TO_REMOTE = direction_between(Tier.CPU, Tier.REMOTE)
Direction.REMOTE_TO_CPU = direction_between(Tier.REMOTE, Tier.CPU)
#: The directions between built-in tiers, in the order reports list them.
BUILT_IN_DIRECTIONS: tuple[Direction, ...] = (
    Direction.GPU_TO_CPU, Direction.CPU_TO_GPU, Direction.CPU_TO_NVME, Direction.NVME_TO_CPU,
    Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU,
)  # fmt: skip


class Priority(enum.IntEnum):
    """Queue a chunk runs on. HIGH (swap-in, prefetch) always goes first."""

    HIGH = 0
    LOW = 1


# Tiers and members as module constants, for code that runs per block or per chunk:
# in Python 3.11 a member read off its Enum class (`Priority.HIGH`) takes the
# metaclass's slow attribute path (~0.2-0.4 us); a name imported from here is a
# plain global (and a global read is cheaper than a class attribute's).
GPU_TIER, CPU_TIER, NVME_TIER, REMOTE_TIER = Tier.GPU, Tier.CPU, Tier.NVME, Tier.REMOTE
HIGH_PRIORITY = Priority.HIGH
CPU_TO_GPU, NVME_TO_CPU = Direction.CPU_TO_GPU, Direction.NVME_TO_CPU
CPU_TO_REMOTE, REMOTE_TO_CPU = Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU


@dataclass(frozen=True)
class TransferChunk:
    """A batch of whole-block copies: src_slots[i] -> dst_slots[i].

    Invariant: len(src_slots) == len(dst_slots) >= 1 and every slot appears
    once per side. `num_bytes` = len(src_slots) * block bytes. A remote chunk
    (`Direction.keyed`) also names each block's key: `keys[i]` is the block
    copied by slot pair i, and the remote side's slots are 0..n-1.
    """

    transfer_id: int
    direction: Direction
    priority: Priority
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    num_bytes: int
    keys: tuple[bytes, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.src_slots)


@dataclass(frozen=True)
class TransferResult:
    """What the copy engine reports for one finished chunk.

    Times are seconds on the engine's clock (wall clock for the real engine,
    virtual for the simulator). `failed_dst_slots` lists destination slots
    whose bytes must not be trusted (e.g. an NVMe write hit ENOSPC); the
    control plane treats those block copies as lost.
    """

    transfer_id: int
    success: bool
    num_bytes: int
    start_s: float
    end_s: float
    error: str | None = None
    failed_dst_slots: tuple[int, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class CopyEngine(ABC):
    """Executes transfer chunks on two priority queues.

    Called by the swapper only, from one thread:
      1. `submit(chunk)` any number of times; returns at once.
      2. `poll()` each step: results of chunks finished since the last poll.
      3. `wait(transfer_id)` when a step cannot go on without that chunk
         (a swap-in stall); returns its result, which a later poll will not
         report again.
      4. `close()` once at shutdown, after `wait_all()`.
    A HIGH chunk never waits behind more than one LOW chunk.
    """

    @abstractmethod
    def submit(self, chunk: TransferChunk) -> None: ...

    @abstractmethod
    def poll(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, transfer_id: int) -> TransferResult: ...

    @abstractmethod
    def wait_all(self) -> list[TransferResult]: ...

    @abstractmethod
    def close(self) -> None: ...
