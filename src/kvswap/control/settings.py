"""Plain settings the control plane is built with (validated at the edge).

The control plane never reads the pydantic configuration: `kvswap.drive`
turns a validated `KvSwapConfig` into these frozen records once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.errors import KvSwapError


@dataclass(frozen=True)
class SwapSettings:
    """Watermarks are fractions of a tier's blocks; chunks are counted in blocks."""

    block_bytes: int
    swap_out_high_watermark: float = 0.85  # GPU occupancy where swap-out starts
    swap_out_low_watermark: float = 0.65  # where it stops (also the admission ceiling)
    swap_out_chunk_blocks: int = 8
    swap_in_chunk_blocks: int = 4
    cpu_demote_high_watermark: float = 0.90
    cpu_demote_low_watermark: float = 0.80


#: Keys asked in one lookup call (one page) at most by default: one pipelined round
#: trip of 512 EXISTS is well under a millisecond of store time. A longer prompt asks
#: its next page only while the store holds every key of the page before.
DEFAULT_MAX_LOOKUP_BLOCKS = 512


@dataclass(frozen=True)
class RemoteSettings:
    """How the swapper uses a shared remote store (`kvswap.base.remote_index`).

    `namespace` is the store's key prefix; it is the model fingerprint (weights
    included) unless the configuration names one, so two models never share KV.
    The data plane prefixes every key with it; the control plane only passes it on.
    """

    namespace: str
    write_policy: RemoteWritePolicy = RemoteWritePolicy.ON_FINISH
    max_lookup_blocks: int = DEFAULT_MAX_LOOKUP_BLOCKS
    # Write chunks in flight at most: a slow store holds CPU slots (the sources stay
    # reserved until the result is polled), so the write-behind waits instead. Results
    # are polled between steps, so this also caps the blocks written per step: 4
    # chunks of 8 blocks (32 a step) held demotion to the store under 1 GB/s at
    # sim_scale's shape (2 MiB blocks, ~70 ms steps), less than it needed.
    max_inflight_write_chunks: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise KvSwapError(f"remote namespace = {self.namespace!r}; allowed: a non-empty string")
        for name in ("max_lookup_blocks", "max_inflight_write_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvSwapError(f"{name} = {value!r}; allowed: an integer >= 1")
