"""What the control plane asks of a shared remote store: which keys it holds.

The control plane decides; the data plane talks to the store. A prefix that
misses on every local tier is looked up here, in one bounded round trip:

    swapper --lookup(keys)--> RemoteIndex        (engine: pipelined EXISTS on Redis;
            <-- n present --                      simulator: a shared modelled store)

Hits become blocks with a remote copy and are fetched like NVMe blocks are:
`Direction.REMOTE_TO_CPU` on the HIGH queue, then `CPU_TO_GPU`. Writes are
`Direction.CPU_TO_REMOTE` chunks on the LOW queue. A key that vanished or a
value that fails its checks comes back as a failed destination slot of its
chunk: the block is lost and recomputed, never trusted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class RemoteIndex(ABC):
    """Presence of block keys in the shared store.

    Called by the swapper only, from the control thread. Never raises for a
    store problem: an unreachable or slow store answers 0 (a miss), and the
    data plane counts the outage.
    """

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds (a prefix: the first
        absent key ends it). At most one round trip, bounded by the store timeout."""

    @property
    @abstractmethod
    def available(self) -> bool:
        """False while the store is known to be down (lookups and writes are skipped)."""

    @property
    def holds_keys(self) -> bool:
        """Whether `hold` keeps a key in the store (`SecondaryTier.holds_keys`): then the
        block store (`kvswap.control.store`) holds the keys of a paused or waiting
        sequence's blocks, from their write on. Default: False."""
        return False

    def hold(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - most stores cannot hold
        """Keep `keys` from eviction until as many `release`s. Default: nothing."""

    def release(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - as `hold`
        """End one `hold` of each of `keys`. Default: nothing."""

    @property
    def local(self) -> bool:
        """Whether the tier is this process's own (the NVMe slab by key): its copies keep
        a block remembered, as a copy on a slot tier does, and it says what it evicts
        (`evicted_keys`), so the block store drops those copies. Default: False (a store
        shared with others: a block known only there is forgotten, and found again by
        a lookup)."""
        return False

    def evicted_keys(self) -> Sequence[bytes]:
        """The keys a local tier evicted since the last call, oldest first (each once).
        Default: none."""
        return ()

    @property
    def capacity_blocks(self) -> int | None:
        """The blocks the tier holds at most, where it knows (the NVMe slab: its slots):
        a local tier with one is reported with its occupancy. Default: None."""
        return None
