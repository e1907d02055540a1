"""A keyed tier as the simulator models it: a store of keys, the link to it, its policy.

The control plane keeps a list of keyed tiers below the pinned pool, fastest
first (`kvswap.control.remote_tier`); the simulator models each as

    store          a `SharedRemoteStore` (shared by engines, or kvswap's NVMe slab by
                   key: `SharedRemoteStore.holding`, this engine's own when `local`)
    link           how it is reached (`KeyedLink`): each way's rate, a chunk's
                   latency, a lookup's round trip, and whether reads and writes
                   each have a link (a NIC) or share one (a drive)
    write_policy   when the control plane writes to it (None: `remote_write_policy`)

`KeyedLink.remote(profile)` is the profile's link to a shared store;
`KeyedLink.nvme(profile)` its NVMe drive reached by key from this process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvswap.base.eviction_policy import EvictionPolicy
from kvswap.base.write_policy import WRITE_POLICIES
from kvswap.sim.hardware import HardwareProfile
from kvswap.sim.remote_store import SharedRemoteStore

GB = 1e9


@dataclass(frozen=True)
class KeyedLink:
    """How a modelled keyed tier is reached (rates in GB/s, 1e9 B/s)."""

    read_gb_per_s: float
    write_gb_per_s: float
    chunk_latency_s: float  # before a chunk's bytes: a round trip, or a drive's latency
    lookup_s: float  # one lookup call (0: an index in this process)
    duplex: bool = True  # a link each way (a NIC); False: reads and writes queue on one

    def __post_init__(self) -> None:
        for name in ("read_gb_per_s", "write_gb_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("chunk_latency_s", "lookup_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def remote(cls, profile: HardwareProfile) -> KeyedLink:
        """The profile's link to a shared store: one round trip per chunk and lookup."""
        rtt_s = profile.remote_rtt_ms / 1e3
        return cls(profile.remote_gb_per_s, profile.remote_gb_per_s, rtt_s, rtt_s)

    @classmethod
    def nvme(cls, profile: HardwareProfile) -> KeyedLink:
        """The profile's NVMe drive by key: its rates and latency, one link both ways,
        looked up in this process."""
        return cls(profile.nvme_read_gb_per_s, profile.nvme_write_gb_per_s,
                   profile.nvme_latency_s, 0.0, duplex=False)  # fmt: skip

    def chunk_time_s(self, num_bytes: int, *, load: bool) -> tuple[float, float]:
        """(overhead, data time) of a chunk of `num_bytes`, a load or a store."""
        gb_per_s = self.read_gb_per_s if load else self.write_gb_per_s
        return self.chunk_latency_s, num_bytes / (gb_per_s * GB)


@dataclass(frozen=True)
class ModelledKeyedTier:
    """One keyed tier of a simulated engine (module docstring)."""

    store: SharedRemoteStore
    link: KeyedLink | None = None  # None: the profile's remote link
    write_policy: str | None = None  # None: as `tiers.remote_write_policy` says

    @classmethod
    def slab(
        cls, num_blocks: int, block_bytes: int, profile: HardwareProfile, policy: EvictionPolicy
    ) -> ModelledKeyedTier:
        """An engine's own NVMe slab of `num_blocks` by key (kvswap's `NvmeTier` opened
        `local`, with its index): evicting by `policy` (the engine's
        `nvme_eviction_policy`, built for `num_blocks`) and never a held key, saying
        what it evicted, reached over the profile's drive, written as blocks leave the
        pinned pool."""
        store = SharedRemoteStore.holding(num_blocks, block_bytes, policy, local=True)
        return cls(store, KeyedLink.nvme(profile), "on_demote")

    def __post_init__(self) -> None:
        if self.write_policy is not None and self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy = {self.write_policy!r}; allowed: None, {', '.join(WRITE_POLICIES)}"
            )
