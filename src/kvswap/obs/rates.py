"""Link throughput over the last second or so, from cumulative byte counters.

The samples carry bytes moved *since the start*; a rate needs a difference
over a span of run time. `TrailingRate` keeps the samples of the last
`window_s` (plus one older, so the span always covers the window once the run
is that long) and divides.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class TrailingRate:
    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, t_s: float, totals: Mapping[str, int]) -> None:
        self._samples.append((t_s, dict(totals)))
        # Drop the oldest while the next one still spans the whole window.
        while len(self._samples) > 2 and t_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def per_s(self) -> dict[str, float]:
        """Units per second of run time over the trailing window, per key.

        Before the second sample, the rate is taken from the run's start (t = 0,
        all counters 0)."""
        if not self._samples:
            return {}
        end_t_s, end = self._samples[-1]
        if len(self._samples) == 1:
            start_t_s, start = 0.0, dict.fromkeys(end, 0)
        else:
            start_t_s, start = self._samples[0]
        span_s = end_t_s - start_t_s
        if span_s <= 0:
            return dict.fromkeys(end, 0.0)
        return {key: (end[key] - start.get(key, 0)) / span_s for key in end}


def format_rate(bytes_per_s: float) -> str:
    """'1.23 GB/s', '45.6 MB/s', '7.8 kB/s' (decimal units, as link speeds are quoted)."""
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def rate_unit(peak_gb_per_s: float) -> tuple[float, str]:
    """(multiplier from GB/s, unit label) that puts `peak_gb_per_s` on a readable scale."""
    for threshold_gb_per_s, scale, unit in ((1.0, 1.0, "GB/s"), (1e-3, 1e3, "MB/s")):
        if peak_gb_per_s >= threshold_gb_per_s:
            return scale, unit
    return 1e6, "kB/s"
