"""A mergeable latency histogram with log-spaced buckets, for percentiles over time.

Why not keep every latency: a long simulated run emits millions of tokens, and
the time series needs percentiles per window *and* per merged window (when it
downsamples). Log buckets 2% wide keep any percentile within 1% of the exact
nearest-rank value, merge by adding counts, and stay small (a window's
latencies span a few dozen buckets).

    bucket i holds [FLOOR_S * RATIO**i, FLOOR_S * RATIO**(i + 1)); values below
    FLOOR_S (including 0) go to bucket 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

RATIO = 1.02
FLOOR_S = 1e-6
_LOG_RATIO = math.log(RATIO)


def bucket_of(value_s: float) -> int:
    if value_s <= FLOOR_S:
        return 0
    return int(math.log(value_s / FLOOR_S) / _LOG_RATIO)


def bucket_value_s(index: int) -> float:
    """The bucket's geometric centre: within 1% of anything it holds."""
    return float(FLOOR_S * RATIO ** (index + 0.5))


class LogHistogram:
    """Counts per bucket. Mutable while a window fills; treat as read-only once
    it is part of a `SeriesPoint` (combine with `merged`, which copies)."""

    def __init__(
        self,
        counts: Mapping[int, int] | None = None,
        min_s: float | None = None,
        max_s: float | None = None,
    ):
        self.counts: dict[int, int] = dict(counts) if counts else {}
        self.count = sum(self.counts.values())
        # The exact extremes: estimates are clamped to them, so a constant latency
        # reads back exactly and P100 is the true maximum.
        self.min_s, self.max_s = min_s, max_s

    def add(self, value_s: float) -> None:
        index = bucket_of(value_s)
        self.counts[index] = self.counts.get(index, 0) + 1
        self.count += 1
        self.min_s = value_s if self.min_s is None else min(self.min_s, value_s)
        self.max_s = value_s if self.max_s is None else max(self.max_s, value_s)

    def add_all(self, values_s: Iterable[float]) -> None:
        for value_s in values_s:
            self.add(value_s)

    def merged(self, *others: LogHistogram) -> LogHistogram:
        out = LogHistogram(self.counts, self.min_s, self.max_s)
        for other in others:
            for index, n in other.counts.items():
                out.counts[index] = out.counts.get(index, 0) + n
            out.count += other.count
            lows = [v for v in (out.min_s, other.min_s) if v is not None]
            highs = [v for v in (out.max_s, other.max_s) if v is not None]
            out.min_s = min(lows) if lows else None
            out.max_s = max(highs) if highs else None
        return out

    def _clamp(self, value_s: float) -> float:
        if self.min_s is not None:
            value_s = max(value_s, self.min_s)
        if self.max_s is not None:
            value_s = min(value_s, self.max_s)
        return value_s

    def quantile_s(self, fraction: float) -> float | None:
        """Nearest-rank quantile (as `kvswap.percentiles.nearest_rank`); None when empty."""
        if self.count == 0:
            return None
        rank = max(1, math.ceil(fraction * self.count))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return self._clamp(bucket_value_s(index))
        return self._clamp(bucket_value_s(max(self.counts)))  # unreachable: seen ends at count

    def quantile_ms(self, fraction: float) -> float | None:
        value_s = self.quantile_s(fraction)
        return None if value_s is None else value_s * 1e3

    def count_at_or_above_s(self, value_s: float) -> int:
        """Values in `value_s`'s bucket or above it: "at or above" to the bucket's 2%
        resolution (a histogram cannot split a bucket). With `value_s` a quantile of this
        histogram, or of one it is part of, the quantile's own values count."""
        first = bucket_of(value_s)
        return sum(n for index, n in self.counts.items() if index >= first)

    def cdf(self) -> list[tuple[float, float]]:
        """(latency_s, fraction of latencies <= it) per occupied bucket, ascending."""
        points: list[tuple[float, float]] = []
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            points.append((self._clamp(bucket_value_s(index)), seen / self.count))
        return points

    def to_json(self) -> dict[str, object]:
        """{"min_s", "max_s", "counts": {bucket index: count}}."""
        return {
            "min_s": self.min_s,
            "max_s": self.max_s,
            "counts": {str(index): n for index, n in sorted(self.counts.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> LogHistogram:
        counts = data.get("counts")
        low, high = data.get("min_s"), data.get("max_s")
        return cls(
            {int(k): v for k, v in counts.items() if isinstance(v, int)}
            if isinstance(counts, Mapping)
            else {},
            float(low) if isinstance(low, int | float) else None,
            float(high) if isinstance(high, int | float) else None,
        )
