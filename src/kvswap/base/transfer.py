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
from dataclasses import dataclass, field
from typing import ClassVar

from kvswap.base.tier import Tier


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


# Members as module constants, for code that runs per block or per chunk: in
# Python 3.11 a member read off its Enum class (`Priority.HIGH`) takes the
# metaclass's slow attribute path (~0.2-0.4 us); a name imported from here is a
# plain global (and a global read is cheaper than a class attribute's; the tiers'
# are in `kvswap.base.tier`).
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
