"""One registry of what the KV store did: bytes, seconds, waits, stalls, evictions.

The remote tier's figures are here in blocks (lookups, hits, failed fetches,
writes); the data plane's own counters (corrupt values, outages) are not the
control plane's to know and reach the summary through the backend.

Torch-free and clock-free: the swapper records into it from transfer results
and its own decisions, so the engine and the simulator fill it the same way.
Exporters (Prometheus, reports) read `snapshot()`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvswap.base.tier import CPU_TIER, Tier, reported_tiers
from kvswap.base.transfer import BUILT_IN_DIRECTIONS, Direction, direction_between


@dataclass
class KVMetrics:
    # Bytes of every chunk tried, except to the store: there only the blocks it
    # stored (a skipped or refused write moved nothing). Seconds and transfers
    # count every chunk tried.
    bytes_by_direction: Counter[Direction] = field(default_factory=Counter)
    seconds_by_direction: dict[Direction, float] = field(
        default_factory=lambda: dict.fromkeys(BUILT_IN_DIRECTIONS, 0.0)
    )
    transfers_by_direction: Counter[Direction] = field(default_factory=Counter)
    failed_transfers: int = 0  # not remote writes: those are remote_write_failures
    swap_wait_s: float = 0.0
    sync_stalls: int = 0
    evictions_by_reason: Counter[str] = field(default_factory=Counter)
    protected_block_saves: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    lost_blocks: int = 0
    prefix_hit_blocks_by_tier: Counter[Tier] = field(default_factory=Counter)
    peak_used_blocks_by_tier: Counter[Tier] = field(default_factory=Counter)
    # The keyed tiers shared with others (the store, tiers of one's own; not the NVMe
    # slab, this process's), in blocks (their bytes and seconds are their directions').
    remote_lookups: int = 0  # lookup calls (one round trip each)
    remote_lookup_misses: int = 0  # lookups that found nothing
    remote_lookup_blocks: int = 0  # keys asked, over all lookups
    remote_found_blocks: int = 0  # of those, held by the store (the hit rate's numerator)
    remote_fetch_failures: int = 0  # found, but the fetch failed: the block was recomputed
    remote_writes: int = 0  # blocks written
    remote_write_failures: int = 0  # blocks whose write failed or the store skipped
    remote_writes_skipped: int = 0  # blocks due for a write never sent (store down, copy gone)
    # The keyed tiers in use, fastest first (set by the swapper that has them): each is
    # reported in place of the built-in tier of its name, or after them.
    keyed_tiers: tuple[Tier, ...] = ()

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers reported, fastest first (`reported_tiers`)."""
        return reported_tiers(self.keyed_tiers)

    @property
    def directions(self) -> tuple[Direction, ...]:
        """The directions reported: the GPU's and the pinned pool's, then each tier
        below's two (down, up), in the order of `tiers`."""
        below = [tier for tier in self.tiers if tier.rank > CPU_TIER.rank]
        pairs = ((direction_between(CPU_TIER, t), direction_between(t, CPU_TIER)) for t in below)
        return (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU, *(d for pair in pairs for d in pair))

    def record_transfer(self, direction: Direction, num_bytes: int, seconds: float) -> None:
        self.bytes_by_direction[direction] += num_bytes
        self.seconds_by_direction[direction] = (
            self.seconds_by_direction.get(direction, 0.0) + seconds
        )
        self.transfers_by_direction[direction] += 1

    def gb_per_s(self, direction: Direction) -> float:
        """Mean throughput while transfers in `direction` were running (GB/s, 1e9 B/s)."""
        seconds = self.seconds_by_direction.get(direction, 0.0)
        return self.bytes_by_direction[direction] / seconds / 1e9 if seconds > 0 else 0.0

    def snapshot(self) -> dict[str, object]:
        """Plain values keyed by metric name, for JSON and exporters."""
        out: dict[str, object] = {}
        for direction in self.directions:
            out[f"bytes_{direction.value}"] = self.bytes_by_direction[direction]
            seconds = self.seconds_by_direction.get(direction, 0.0)
            out[f"seconds_{direction.value}"] = round(seconds, 9)
            out[f"transfers_{direction.value}"] = self.transfers_by_direction[direction]
        out.update(
            failed_transfers=self.failed_transfers,
            swap_wait_s=round(self.swap_wait_s, 9),
            sync_stalls=self.sync_stalls,
            evictions_by_reason=dict(sorted(self.evictions_by_reason.items())),
            protected_block_saves=self.protected_block_saves,
            prefetch_hits=self.prefetch_hits,
            prefetch_misses=self.prefetch_misses,
            lost_blocks=self.lost_blocks,
            prefix_hit_blocks_by_tier={
                t.value: self.prefix_hit_blocks_by_tier[t] for t in self.tiers
            },
            peak_used_blocks_by_tier={
                t.value: self.peak_used_blocks_by_tier[t] for t in self.tiers
            },
            remote_lookups=self.remote_lookups,
            remote_lookup_misses=self.remote_lookup_misses,
            remote_lookup_blocks=self.remote_lookup_blocks,
            remote_found_blocks=self.remote_found_blocks,
            remote_fetch_failures=self.remote_fetch_failures,
            remote_writes=self.remote_writes,
            remote_write_failures=self.remote_write_failures,
            remote_writes_skipped=self.remote_writes_skipped,
        )
        return out
