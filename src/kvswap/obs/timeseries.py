"""The run over time, downsampled: occupancy, link throughput, swap-wait, latencies.

`TimeSeriesRecorder` is a `StepObserver`. It folds consecutive steps into
windows at least `window_s` of run time long; each closed window becomes a
`SeriesPoint`. Memory stays bounded whatever the run length: when the number
of points reaches twice `max_points`, neighbouring points are merged pairwise
and the window length doubles. Points therefore tile the run without gaps:

    |--p0--|--p1--|--p2--| ... |--open window--|
    0     end0   end1   end2         (t_s of the latest step)

Per window: bytes moved per direction (so throughput = bytes / duration; the
remote store's are `cpu_to_remote` / `remote_to_cpu`), step and swap-wait
seconds (so the window's swap-wait share), mean and peak occupancy per tier,
latency histograms (`LogHistogram`, mergeable), and the remote tier's hit
tokens and misses.
For the whole run, beside: token latencies by the class of their step
(`TailLatencies`: swap wait, prefill, plain decode), which windows cannot keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvswap.base.tier import BUILT_IN_TIERS
from kvswap.base.transfer import BUILT_IN_DIRECTIONS
from kvswap.obs.jsonvalues import as_mapping, float_map, int_map, integer_or, lookup, number_or
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.tail import TailLatencies, TailRecorder

DIRECTIONS: tuple[str, ...] = tuple(d.value for d in BUILT_IN_DIRECTIONS)
TIERS: tuple[str, ...] = tuple(t.value for t in BUILT_IN_TIERS)


@dataclass(frozen=True)
class SeriesPoint:
    """One window (start_s, end_s] of run time; counters are what happened inside it,
    `*_blocks_by_tier` and `num_*` are the state at its end."""

    start_s: float
    end_s: float
    num_steps: int
    step_s: float
    swap_wait_s: float
    bytes_by_direction: dict[str, int]
    usage_mean_by_tier: dict[str, float]  # mean over the window's steps of used / capacity
    usage_max_by_tier: dict[str, float]
    used_blocks_by_tier: dict[str, int]
    capacity_blocks_by_tier: dict[str, int]
    num_running: int
    num_waiting: int
    num_preempted: int
    tokens_generated: int  # cumulative at the window's end
    itl: LogHistogram = field(compare=False)  # inter-token latencies emitted in the window
    ttft: LogHistogram = field(compare=False)
    remote_hit_tokens: int = 0  # prompt tokens found in the remote store in the window
    remote_misses: int = 0  # remote lookups that found nothing + fetches that failed

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def mid_s(self) -> float:
        return (self.start_s + self.end_s) / 2

    def gb_per_s(self, direction: str) -> float:
        """Bytes moved in `direction` during the window / its duration, in GB/s (1e9 B/s)."""
        duration_s = self.duration_s
        moved = self.bytes_by_direction.get(direction, 0)
        return moved / duration_s / 1e9 if duration_s > 0 else 0.0

    @property
    def swap_wait_share(self) -> float:
        return self.swap_wait_s / self.step_s if self.step_s > 0 else 0.0

    def merge(self, later: SeriesPoint) -> SeriesPoint:
        """This window followed by `later`, as one window."""
        steps = self.num_steps + later.num_steps

        def mean(tier: str) -> float:
            total = self.usage_mean_by_tier.get(tier, 0.0) * self.num_steps
            total += later.usage_mean_by_tier.get(tier, 0.0) * later.num_steps
            return total / steps if steps else 0.0

        return SeriesPoint(
            start_s=self.start_s,
            end_s=later.end_s,
            num_steps=steps,
            step_s=self.step_s + later.step_s,
            swap_wait_s=self.swap_wait_s + later.swap_wait_s,
            bytes_by_direction={
                d: self.bytes_by_direction.get(d, 0) + later.bytes_by_direction.get(d, 0)
                for d in _directions(self.bytes_by_direction, later.bytes_by_direction)
            },
            usage_mean_by_tier={t: mean(t) for t in TIERS},
            usage_max_by_tier={
                t: max(self.usage_max_by_tier.get(t, 0.0), later.usage_max_by_tier.get(t, 0.0))
                for t in TIERS
            },
            used_blocks_by_tier=dict(later.used_blocks_by_tier),
            capacity_blocks_by_tier=dict(later.capacity_blocks_by_tier),
            num_running=later.num_running,
            num_waiting=later.num_waiting,
            num_preempted=later.num_preempted,
            tokens_generated=later.tokens_generated,
            itl=self.itl.merged(later.itl),
            ttft=self.ttft.merged(later.ttft),
            remote_hit_tokens=self.remote_hit_tokens + later.remote_hit_tokens,
            remote_misses=self.remote_misses + later.remote_misses,
        )

    def to_json(self) -> dict[str, object]:
        """Raw fields plus derived figures (throughput, share, percentiles) for readers."""
        return {
            "start_s": self.start_s,  # raw fields unrounded: from_json restores them exactly
            "end_s": self.end_s,
            "num_steps": self.num_steps,
            "step_s": self.step_s,
            "swap_wait_s": self.swap_wait_s,
            "swap_wait_share": round(self.swap_wait_share, 6),
            "bytes_by_direction": dict(self.bytes_by_direction),
            "gb_per_s_by_direction": {
                d: round(self.gb_per_s(d), 6) for d in _directions(self.bytes_by_direction)
            },
            "usage_mean_by_tier": dict(self.usage_mean_by_tier),
            "usage_max_by_tier": dict(self.usage_max_by_tier),
            "used_blocks_by_tier": dict(self.used_blocks_by_tier),
            "capacity_blocks_by_tier": dict(self.capacity_blocks_by_tier),
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preempted": self.num_preempted,
            "tokens_generated": self.tokens_generated,
            "itl_ms": _percentiles_ms(self.itl),
            "ttft_ms": _percentiles_ms(self.ttft),
            "itl_histogram": self.itl.to_json(),
            "ttft_histogram": self.ttft.to_json(),
            "remote_hit_tokens": self.remote_hit_tokens,
            "remote_misses": self.remote_misses,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> SeriesPoint:
        return cls(
            start_s=number_or(data, "start_s"),
            end_s=number_or(data, "end_s"),
            num_steps=integer_or(data, "num_steps"),
            step_s=number_or(data, "step_s"),
            swap_wait_s=number_or(data, "swap_wait_s"),
            bytes_by_direction=int_map(data, "bytes_by_direction"),
            usage_mean_by_tier=float_map(data, "usage_mean_by_tier"),
            usage_max_by_tier=float_map(data, "usage_max_by_tier"),
            used_blocks_by_tier=int_map(data, "used_blocks_by_tier"),
            capacity_blocks_by_tier=int_map(data, "capacity_blocks_by_tier"),
            num_running=integer_or(data, "num_running"),
            num_waiting=integer_or(data, "num_waiting"),
            num_preempted=integer_or(data, "num_preempted"),
            tokens_generated=integer_or(data, "tokens_generated"),
            itl=_histogram(data, "itl_histogram"),
            ttft=_histogram(data, "ttft_histogram"),
            remote_hit_tokens=integer_or(data, "remote_hit_tokens"),
            remote_misses=integer_or(data, "remote_misses"),
        )


@dataclass(frozen=True)
class TimeSeries:
    """The windows in time order, and the whole run's latency histograms."""

    points: tuple[SeriesPoint, ...]
    itl: LogHistogram = field(compare=False)
    ttft: LogHistogram = field(compare=False)
    # The whole run's token latencies by step class (obs/tail.py); None in a series
    # read from a report written before they were recorded.
    tail: TailLatencies | None = field(default=None, compare=False)

    @property
    def duration_s(self) -> float:
        return self.points[-1].end_s - self.points[0].start_s if self.points else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "points": [p.to_json() for p in self.points],
            "itl_ms": _percentiles_ms(self.itl),
            "ttft_ms": _percentiles_ms(self.ttft),
            "itl_histogram": self.itl.to_json(),
            "ttft_histogram": self.ttft.to_json(),
            **({} if self.tail is None else {"tail_latencies": self.tail.to_json()}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> TimeSeries:
        raw = lookup(data, "points")
        points = raw if isinstance(raw, list) else []
        tail = lookup(data, "tail_latencies")
        return cls(
            points=tuple(SeriesPoint.from_json(as_mapping(p, "time series point")) for p in points),
            itl=_histogram(data, "itl_histogram"),
            ttft=_histogram(data, "ttft_histogram"),
            tail=TailLatencies.from_json(tail) if isinstance(tail, Mapping) else None,
        )


@dataclass(frozen=True)
class _Remote:
    """The remote tier's cumulative counters at a window's edge."""

    hit_tokens: int
    misses: int


def _directions(*seen: Mapping[str, object]) -> list[str]:
    """The built-in directions, then any other a sample names (a keyed tier's past the
    first, "cpu_to_remote2"), in order of first sight."""
    return list(dict.fromkeys([*DIRECTIONS, *(d for each in seen for d in each)]))


class _Window:
    """The window being filled: totals at its start, sums since."""

    def __init__(self, start_s: float, start_bytes: Mapping[str, int], start_remote: _Remote):
        self.start_s = start_s
        self.start_bytes = dict(start_bytes)
        self.start_remote = start_remote
        self.num_steps = 0
        self.step_s = self.swap_wait_s = 0.0
        self.usage_sum = dict.fromkeys(TIERS, 0.0)
        self.usage_max = dict.fromkeys(TIERS, 0.0)
        self.itl = LogHistogram()
        self.ttft = LogHistogram()
        self.last: StepSample | None = None

    def add(self, sample: StepSample) -> None:
        self.num_steps += 1
        self.step_s += sample.step_s
        self.swap_wait_s += sample.swap_wait_s
        for tier in TIERS:
            usage = _usage(sample, tier)
            self.usage_sum[tier] += usage
            self.usage_max[tier] = max(self.usage_max[tier], usage)
        self.itl.add_all(sample.token_latencies_s)
        self.ttft.add_all(sample.ttfts_s)
        self.last = sample

    def point(self) -> SeriesPoint:
        last = self.last
        assert last is not None, "a window is created by its first step"
        return SeriesPoint(
            start_s=self.start_s,
            end_s=last.t_s,
            num_steps=self.num_steps,
            step_s=self.step_s,
            swap_wait_s=self.swap_wait_s,
            bytes_by_direction={
                d: last.bytes_by_direction.get(d, 0) - self.start_bytes.get(d, 0)
                for d in _directions(last.bytes_by_direction)
            },
            usage_mean_by_tier={t: self.usage_sum[t] / self.num_steps for t in TIERS},
            usage_max_by_tier=dict(self.usage_max),
            used_blocks_by_tier=dict(last.used_blocks_by_tier),
            capacity_blocks_by_tier=dict(last.capacity_blocks_by_tier),
            num_running=last.num_running,
            num_waiting=last.num_waiting,
            num_preempted=last.num_preempted,
            tokens_generated=last.tokens_generated,
            itl=self.itl.merged(),  # a copy: the open window keeps filling its own
            ttft=self.ttft.merged(),
            remote_hit_tokens=last.remote_hit_tokens - self.start_remote.hit_tokens,
            remote_misses=last.remote_misses - self.start_remote.misses,
        )


class TimeSeriesRecorder(StepObserver):
    """Keeps between `max_points` and 2 x `max_points` windows (once the run is long
    enough); `series()` may be called at any time, during or after the run."""

    def __init__(self, max_points: int = 150, window_s: float = 0.005):
        if max_points < 1 or window_s <= 0:
            raise ValueError("max_points must be >= 1 and window_s > 0")
        self.max_points = max_points
        self.window_s = window_s
        self._points: list[SeriesPoint] = []
        self._open: _Window | None = None
        self._end_s = 0.0
        self._end_bytes: dict[str, int] = dict.fromkeys(DIRECTIONS, 0)
        self._end_remote = _Remote(0, 0)
        self.itl = LogHistogram()
        self.ttft = LogHistogram()
        self.tail = TailRecorder()  # per-step facts the windows average away

    def on_step(self, sample: StepSample) -> None:
        self.tail.on_step(sample)
        if self._open is None:
            self._open = _Window(self._end_s, self._end_bytes, self._end_remote)
        window = self._open
        window.add(sample)
        self.itl.add_all(sample.token_latencies_s)
        self.ttft.add_all(sample.ttfts_s)
        if sample.t_s - window.start_s >= self.window_s:
            self._points.append(window.point())
            self._open = None
            self._end_s = sample.t_s
            self._end_bytes = dict(sample.bytes_by_direction)
            self._end_remote = _Remote(sample.remote_hit_tokens, sample.remote_misses)
            if len(self._points) >= 2 * self.max_points:
                self._compact()

    def _compact(self) -> None:
        pairs = [
            self._points[i].merge(self._points[i + 1]) if i + 1 < len(self._points)
            else self._points[i]
            for i in range(0, len(self._points), 2)
        ]  # fmt: skip
        self._points = pairs
        self.window_s *= 2

    def series(self) -> TimeSeries:
        points = list(self._points)
        if self._open is not None:
            points.append(self._open.point())
        return TimeSeries(
            tuple(points), self.itl.merged(), self.ttft.merged(), self.tail.latencies()
        )


def _usage(sample: StepSample, tier: str) -> float:
    capacity = sample.capacity_blocks_by_tier.get(tier, 0)
    return sample.used_blocks_by_tier.get(tier, 0) / capacity if capacity else 0.0


def _percentiles_ms(histogram: LogHistogram) -> dict[str, float | None]:
    def ms(fraction: float) -> float | None:
        value = histogram.quantile_ms(fraction)
        return None if value is None else round(value, 3)

    return {"p50": ms(0.50), "p95": ms(0.95), "p99": ms(0.99)}


def _histogram(data: Mapping[str, object], key: str) -> LogHistogram:
    value = lookup(data, key)
    return LogHistogram.from_json(value) if isinstance(value, Mapping) else LogHistogram()
