"""Transfers as the control plane sees them: ids, slots, directions, priorities.

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
from abc import ABC, abstractmethod
from dataclasses import dataclass


class Tier(enum.Enum):
    """Where a copy of a block can live, fastest first."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"
    REMOTE = "remote"  # a shared store (Redis protocol), addressed by block key

    # Members are singletons compared by identity, so the identity hash is a valid
    # hash; Enum's default hashes the member's name in Python, and tiers key every
    # block's copies, which made it a top cost of large simulations.
    __hash__ = object.__hash__

    @property
    def spec(self) -> TierSpec:
        return TIER_SPECS[self]


class Addressing(enum.Enum):
    """How a tier's copies are found."""

    SLOTS = "slots"  # fixed slots this process hands out (GPU, pinned CPU, NVMe slab)
    KEYS = "keys"  # by block key, in a store shared between processes (no slots here)


@dataclass(frozen=True)
class TierSpec:
    """A tier, described once: everything the control plane treats differently per
    tier reads it from here (its capacity comes with the store's layout)."""

    tier: Tier
    addressing: Addressing
    # A failed read means the copy itself is bad (a CRC or value check failed, the key
    # vanished), not only that transfer: the copy is never read again.
    checked_reads: bool
    # In this process (memory or a slab it owns): a copy worth remembering a block for.
    # A block known only in a shared store is found again by a lookup.
    local: bool
    # The tier a copy moves through to reach this one (None: the GPU, where KV is
    # computed). Every direction is a pair of a tier and this one.
    above: Tier | None


#: Fastest first: the order is the tiers' speed.
_SLOTS, _KEYS = Addressing.SLOTS, Addressing.KEYS
TIER_SPECS: dict[Tier, TierSpec] = {
    Tier.GPU: TierSpec(Tier.GPU, _SLOTS, checked_reads=False, local=True, above=None),
    Tier.CPU: TierSpec(Tier.CPU, _SLOTS, checked_reads=False, local=True, above=Tier.GPU),
    Tier.NVME: TierSpec(Tier.NVME, _SLOTS, checked_reads=True, local=True, above=Tier.CPU),
    Tier.REMOTE: TierSpec(Tier.REMOTE, _KEYS, checked_reads=True, local=False, above=Tier.CPU),
}
#: The tiers slower than each tier, fastest first: a ready copy on one of them makes
#: that tier's copy free to drop.
TIERS_BELOW: dict[Tier, tuple[Tier, ...]] = {
    tier: tuple(TIER_SPECS)[position + 1 :] for position, tier in enumerate(TIER_SPECS)
}
#: The tiers of this process slower than each tier, fastest first.
LOCAL_TIERS_BELOW: dict[Tier, tuple[Tier, ...]] = {
    tier: tuple(lower for lower in below if TIER_SPECS[lower].local)
    for tier, below in TIERS_BELOW.items()
}
#: The tiers whose copies take a slot of this process (each has a `TierSlots`).
SLOT_TIERS: tuple[Tier, ...] = tuple(
    spec.tier for spec in TIER_SPECS.values() if spec.addressing is Addressing.SLOTS
)
#: The tiers of this process (a block with a copy on one is remembered).
LOCAL_TIERS: tuple[Tier, ...] = tuple(spec.tier for spec in TIER_SPECS.values() if spec.local)


class Direction(enum.Enum):
    """Which way a chunk moves; the value is the metric label."""

    GPU_TO_CPU = "gpu_to_cpu"
    CPU_TO_GPU = "cpu_to_gpu"
    CPU_TO_NVME = "cpu_to_nvme"
    NVME_TO_CPU = "nvme_to_cpu"
    CPU_TO_REMOTE = "cpu_to_remote"
    REMOTE_TO_CPU = "remote_to_cpu"

    __hash__ = object.__hash__  # as for Tier

    @property
    def src_tier(self) -> Tier:
        return _DIRECTION_TIERS[self][0]

    @property
    def dst_tier(self) -> Tier:
        return _DIRECTION_TIERS[self][1]

    @property
    def upward(self) -> bool:
        """Towards the GPU (a swap-in or its first hop): what a step may wait for."""
        return self in _UPWARD


_DIRECTION_TIERS: dict[Direction, tuple[Tier, Tier]] = {
    Direction.GPU_TO_CPU: (Tier.GPU, Tier.CPU),
    Direction.CPU_TO_GPU: (Tier.CPU, Tier.GPU),
    Direction.CPU_TO_NVME: (Tier.CPU, Tier.NVME),
    Direction.NVME_TO_CPU: (Tier.NVME, Tier.CPU),
    Direction.CPU_TO_REMOTE: (Tier.CPU, Tier.REMOTE),
    Direction.REMOTE_TO_CPU: (Tier.REMOTE, Tier.CPU),
}

# Every direction is a tier and the one above it, one way or the other.
for _direction, (_src, _dst) in _DIRECTION_TIERS.items():
    assert _src.spec.above is _dst or _dst.spec.above is _src, _direction
_UPWARD = frozenset(d for d, (src, dst) in _DIRECTION_TIERS.items() if src.spec.above is dst)
_DIRECTION_OF = {tiers: direction for direction, tiers in _DIRECTION_TIERS.items()}


def direction_between(src: Tier, dst: Tier) -> Direction:
    """The direction a chunk from `src` to `dst` moves (adjacent tiers only)."""
    direction = _DIRECTION_OF.get((src, dst))
    if direction is None:
        raise ValueError(f"no direction from {src.value} to {dst.value}: tiers not adjacent")
    return direction


#: Directions whose one side is a store addressed by key: that side is addressed by
#: the chunk's `keys` (its slots are the positions 0..n-1 of `keys`).
REMOTE_DIRECTIONS = frozenset(
    d for d, (src, dst) in _DIRECTION_TIERS.items()
    if Addressing.KEYS in (src.spec.addressing, dst.spec.addressing)
)  # fmt: skip


class Priority(enum.IntEnum):
    """Queue a chunk runs on. HIGH (swap-in, prefetch) always goes first."""

    HIGH = 0
    LOW = 1


# The members as module constants, for code that runs per block or per chunk: in
# Python 3.11 a member read off its Enum class (`Tier.GPU`) takes the metaclass's
# slow attribute path (~0.2-0.4 us); a name imported from here is a plain global.
GPU_TIER, CPU_TIER, NVME_TIER, REMOTE_TIER = Tier.GPU, Tier.CPU, Tier.NVME, Tier.REMOTE
HIGH_PRIORITY = Priority.HIGH
CPU_TO_GPU, NVME_TO_CPU = Direction.CPU_TO_GPU, Direction.NVME_TO_CPU
CPU_TO_REMOTE, REMOTE_TO_CPU = Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU


@dataclass(frozen=True)
class TransferChunk:
    """A batch of whole-block copies: src_slots[i] -> dst_slots[i].

    Invariant: len(src_slots) == len(dst_slots) >= 1 and every slot appears
    once per side. `num_bytes` = len(src_slots) * block bytes. A remote chunk
    (`REMOTE_DIRECTIONS`) also names each block's key: `keys[i]` is the block
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
