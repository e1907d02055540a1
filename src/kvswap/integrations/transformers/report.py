"""The seed article's four numbers for a stretch of `generate`, from the swapper's metrics.

    host<->device   GB/s read (CPU -> GPU) and written (GPU -> CPU) while transfers ran
    swap-wait       share of step time spent waiting for blocks to come up
    token latency   p50 / p95 / p99 of the time between two steps' first layers
    pinned pool     the CPU pool's peak use

plus what moved: bytes and blocks per direction (a test's proof that blocks moved).
A window starts when the cache is built or the last report was taken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

from kvswap.base.transfer import Direction
from kvswap.control.metrics import KVMetrics
from kvswap.percentiles import percentiles_ms


@dataclass(frozen=True)
class CacheReport:
    """What the cache did in one window (module docstring). Rates in GB/s (1e9 B/s)."""

    num_steps: int
    host_to_device_gb_per_s: float
    device_to_host_gb_per_s: float
    swap_wait_share: float
    token_latency_ms: dict[str, float]
    pinned_pool_peak_usage: float
    bytes_by_direction: dict[str, int]
    blocks_by_direction: dict[str, int]
    sync_stalls: int
    prefetch_hits: int
    prefetch_misses: int

    def lines(self) -> list[str]:
        """The four numbers as the live panel words them, one a line."""
        latency = self.token_latency_ms
        return [
            f"host<->device  read {self.host_to_device_gb_per_s:.3f} GB/s  "
            f"write {self.device_to_host_gb_per_s:.3f} GB/s",
            f"swap-wait      {100 * self.swap_wait_share:.1f}% of step time",
            f"token latency  p50 {latency['p50']} ms  p95 {latency['p95']} ms  "
            f"p99 {latency['p99']} ms",
            f"pinned pool    {100 * self.pinned_pool_peak_usage:.0f}% at peak",
        ]


class ReportWindow:
    """Step times and the metrics as they were when the window opened."""

    def __init__(self, metrics: KVMetrics, block_bytes: int) -> None:
        self._metrics = metrics
        self._block_bytes = block_bytes
        self._open()

    def _open(self) -> None:
        metrics = self._metrics
        self._bytes = Counter(metrics.bytes_by_direction)
        self._seconds = dict(metrics.seconds_by_direction)
        self._stalls = metrics.sync_stalls
        self._hits, self._misses = metrics.prefetch_hits, metrics.prefetch_misses
        self._step_starts_s: list[float] = []
        self._wait_s = 0.0

    def step_began(self, now_s: float) -> None:
        self._step_starts_s.append(now_s)

    def waited(self, wait_s: float) -> None:
        self._wait_s += wait_s

    def take(self, now_s: float, pinned_peak_usage: float) -> CacheReport:
        metrics, starts = self._metrics, self._step_starts_s
        directions = metrics.directions  # every tier's, keyed ones by their names
        moved = {d: metrics.bytes_by_direction[d] - self._bytes[d] for d in directions}
        seconds = {
            d: metrics.seconds_by_direction.get(d, 0.0) - self._seconds.get(d, 0.0)
            for d in directions
        }
        span_s = now_s - starts[0] if starts else 0.0
        report = CacheReport(
            num_steps=len(starts),
            host_to_device_gb_per_s=_rate(moved, seconds, Direction.CPU_TO_GPU),
            device_to_host_gb_per_s=_rate(moved, seconds, Direction.GPU_TO_CPU),
            swap_wait_share=round(self._wait_s / span_s, 6) if span_s > 0 else 0.0,
            token_latency_ms=percentiles_ms([b - a for a, b in pairwise(starts)]),
            pinned_pool_peak_usage=round(pinned_peak_usage, 4),
            bytes_by_direction={d.value: n for d, n in moved.items()},
            blocks_by_direction={d.value: n // self._block_bytes for d, n in moved.items()},
            sync_stalls=metrics.sync_stalls - self._stalls,
            prefetch_hits=metrics.prefetch_hits - self._hits,
            prefetch_misses=metrics.prefetch_misses - self._misses,
        )
        self._open()
        return report


def _rate(moved: dict[Direction, int], seconds: dict[Direction, float], d: Direction) -> float:
    return round(moved[d] / seconds[d] / 1e9, 3) if seconds[d] > 0 else 0.0
