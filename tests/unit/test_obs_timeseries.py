"""The downsampled time series: windows tile the run, totals survive merging, JSON round-trips."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.rates import TrailingRate, format_rate
from kvswap.obs.tail import DECODE, PREFILL, STEP_CLASSES, SWAP_WAIT, TailLatencies, TailRecorder
from kvswap.obs.timeseries import TimeSeries, TimeSeriesRecorder
from kvswap.percentiles import percentiles_ms

from .obs_fakes import Step, samples


def test_histogram_percentiles_are_within_one_percent_of_the_exact_nearest_rank() -> None:
    rng = random.Random(7)
    values_s = [rng.lognormvariate(-5, 1.2) for _ in range(5000)]
    histogram = LogHistogram()
    histogram.add_all(values_s)
    exact = percentiles_ms(values_s)
    for name, fraction in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        estimate = histogram.quantile_ms(fraction)
        assert estimate == pytest.approx(exact[name], rel=0.011)
    assert LogHistogram().quantile_ms(0.5) is None
    cdf = histogram.cdf()
    assert cdf[-1][1] == 1.0 and all(a[0] < b[0] for a, b in itertools.pairwise(cdf))


def test_histograms_merge_by_adding_counts() -> None:
    left, right = LogHistogram(), LogHistogram()
    left.add_all([0.001] * 3)
    right.add_all([0.1] * 1)
    merged = left.merged(right)
    assert merged.count == 4 and left.count == 3  # merged() copies
    assert merged.quantile_s(0.75) == pytest.approx(0.001, rel=0.01)
    assert merged.quantile_s(1.0) == pytest.approx(0.1, rel=0.01)
    assert LogHistogram.from_json(merged.to_json()).counts == merged.counts


def test_windows_tile_the_run_and_keep_every_byte_and_second() -> None:
    steps = [Step(step_s=0.002 * (1 + i % 3), moved={"gpu_to_cpu": 1000 * i}) for i in range(400)]
    recorder = TimeSeriesRecorder(max_points=20, window_s=0.005)
    run = samples(steps)
    for sample in run:
        recorder.on_step(sample)
    series = recorder.series()
    points = series.points
    # Compaction kept the count between max_points and twice that, and the windows grew.
    assert 20 <= len(points) < 40
    assert recorder.window_s > 0.005
    assert points[0].start_s == 0.0 and points[-1].end_s == pytest.approx(run[-1].t_s)
    assert all(a.end_s == b.start_s for a, b in itertools.pairwise(points))
    assert sum(p.num_steps for p in points) == 400
    assert sum(p.bytes_by_direction["gpu_to_cpu"] for p in points) == sum(range(400)) * 1000
    assert sum(p.step_s for p in points) == pytest.approx(run[-1].step_total_s)
    assert series.itl.count == 1600 == sum(p.itl.count for p in points)


def test_a_keyed_tier_past_the_first_keeps_its_bytes_through_the_windows() -> None:
    steps = [Step(moved={"remote2_to_cpu": 100}) for _ in range(300)]
    recorder = TimeSeriesRecorder(max_points=10, window_s=0.005)
    for sample in samples(steps):
        recorder.on_step(sample)
    points = recorder.series().points
    assert sum(p.bytes_by_direction["remote2_to_cpu"] for p in points) == 300 * 100
    assert points[0].to_json()["gb_per_s_by_direction"]["remote2_to_cpu"] > 0  # type: ignore[index]


def test_window_figures_throughput_share_and_occupancy() -> None:
    # Ten 10 ms steps, each moving 1 MB GPU->CPU and waiting 2 ms: 100 MB/s, 20% wait.
    steps = [
        Step(step_s=0.01, swap_wait_s=0.002, moved={"gpu_to_cpu": 10**6},
             used={"gpu": 80 if i < 5 else 40, "cpu": 0})
        for i in range(10)
    ]  # fmt: skip
    recorder = TimeSeriesRecorder(window_s=0.05)
    for sample in samples(steps):
        recorder.on_step(sample)
    first, second = recorder.series().points
    assert first.gb_per_s("gpu_to_cpu") == pytest.approx(0.1)
    assert first.swap_wait_share == pytest.approx(0.2)
    assert first.usage_mean_by_tier["gpu"] == pytest.approx(0.8)
    assert second.usage_mean_by_tier["gpu"] == pytest.approx(0.4)
    merged = first.merge(second)
    assert merged.usage_mean_by_tier["gpu"] == pytest.approx(0.6)
    assert merged.usage_max_by_tier["gpu"] == pytest.approx(0.8)
    assert merged.gb_per_s("gpu_to_cpu") == pytest.approx(0.1)


def test_series_round_trips_through_json() -> None:
    recorder = TimeSeriesRecorder()
    for sample in samples([Step(moved={"cpu_to_gpu": 4096}, ttfts_s=(0.05,))] * 30):
        recorder.on_step(sample)
    series = recorder.series()
    again = TimeSeries.from_json(series.to_json())
    assert again == series  # histograms are compared below
    assert [p.itl.counts for p in again.points] == [p.itl.counts for p in series.points]
    assert again.ttft.count == 30
    p50 = series.to_json()["itl_ms"]
    assert isinstance(p50, dict) and p50["p50"] == pytest.approx(10.0, rel=0.01)


def test_counting_the_tail_includes_the_quantile_bucket() -> None:
    histogram = LogHistogram()
    histogram.add_all([0.010] * 95 + [0.0101] * 2 + [0.050] * 3)
    p99_s = histogram.quantile_s(0.99)
    assert p99_s is not None and p99_s == pytest.approx(0.050)
    assert histogram.count_at_or_above_s(p99_s) == 3
    assert histogram.count_at_or_above_s(0.010) == 100  # 10.1 ms shares 10 ms's 2% bucket
    assert LogHistogram().count_at_or_above_s(0.01) == 0


def test_tail_latencies_are_filed_by_what_their_step_did() -> None:
    # Steps 0-9: decode; 10-11: swap wait; 12: a sync stall; 13-14: a prefill chunk.
    run = samples([Step(swap_wait_s=0.004 if i in (10, 11) else 0.0) for i in range(15)])
    run = [
        replace(s, sync_stalls=1 if i >= 12 else 0, num_prefill_tokens=300 if i >= 13 else 0)
        for i, s in enumerate(run)
    ]
    recorder = TimeSeriesRecorder()
    for sample in run:
        recorder.on_step(sample)
    tail = recorder.series().tail
    assert tail is not None
    assert tail.num_steps_by_class == {SWAP_WAIT: 3, PREFILL: 2, DECODE: 10}
    assert {c: tail.histogram(c).count for c in STEP_CLASSES} == {
        SWAP_WAIT: 12,
        PREFILL: 8,
        DECODE: 40,
    }
    # The series is a snapshot: later steps do not reach it.
    recorder.on_step(replace(run[-1], step=15))
    assert tail.num_steps_by_class[PREFILL] == 2
    # JSON and merging keep every count.
    again = TailLatencies.from_json(tail.to_json())
    assert again.attribution() == tail.attribution()
    doubled = tail.merged(again)
    assert doubled.num_steps_by_class[SWAP_WAIT] == 6 and doubled.histogram(DECODE).count == 80
    assert tail.histogram(DECODE).count == 40  # merged() copies


def test_the_tail_attribution_reads_shares_and_percentiles_by_class() -> None:
    recorder = TailRecorder()
    base = samples([Step()])[0]
    for i in range(200):  # every 50th step waits, and its tokens take 80 ms
        waits = i % 50 == 0
        recorder.on_step(replace(base, step=i, swap_wait_s=0.07 if waits else 0.0,
                                 token_latencies_s=(0.08 if waits else 0.01,) * 4))  # fmt: skip
    attribution = recorder.latencies().attribution()
    assert attribution is not None
    assert attribution.num_tokens == 800 and attribution.num_tail_tokens == 16
    assert attribution.share_of_tail_tokens_waiting == 1.0
    assert attribution.share_of_tokens(SWAP_WAIT) == pytest.approx(0.02)
    assert attribution.p99_ms_with_swap_wait == pytest.approx(80.0)
    assert attribution.p99_ms_without_swap_wait == pytest.approx(10.0)
    assert attribution.tail_ratio == pytest.approx(8.0, rel=0.02)  # 2% buckets
    summary = attribution.to_json()
    assert summary["share_of_tail_tokens_waiting"] == 1.0 and summary["num_tail_tokens"] == 16
    assert summary["p99_ms_with_swap_wait"] == 80.0
    assert TailLatencies.empty().attribution() is None


def test_tail_memory_stays_bounded_on_a_long_run() -> None:
    rng = random.Random(3)
    recorder = TailRecorder()
    base = samples([Step()])[0]
    for i in range(20_000):
        latencies = tuple(rng.lognormvariate(-4, 1.0) for _ in range(4))
        recorder.on_step(replace(base, step=i, token_latencies_s=latencies,
                                 swap_wait_s=0.001 if i % 7 == 0 else 0.0))  # fmt: skip
    tail = recorder.latencies()
    assert sum(tail.histogram(c).count for c in STEP_CLASSES) == 80_000
    assert sum(len(tail.histogram(c).counts) for c in STEP_CLASSES) < 1_500


def test_trailing_rate_covers_the_last_window() -> None:
    rate = TrailingRate(window_s=1.0)
    assert rate.per_s() == {}
    rate.add(0.5, {"gpu_to_cpu": 500})
    assert rate.per_s()["gpu_to_cpu"] == pytest.approx(1000.0)  # from t = 0
    for i in range(1, 30):
        rate.add(0.5 + 0.1 * i, {"gpu_to_cpu": 500 + 100 * i})
    assert rate.per_s()["gpu_to_cpu"] == pytest.approx(1000.0)
    rate.add(4.0, {"gpu_to_cpu": 3400})  # idle since: the rate falls
    assert rate.per_s()["gpu_to_cpu"] < 1000.0
    assert format_rate(1.5e9) == "1.5 GB/s" and format_rate(0) == "0 B/s"
    assert not math.isnan(rate.per_s()["gpu_to_cpu"])


def test_windows_count_remote_hits_and_misses_and_keep_them_through_json() -> None:
    recorder = TimeSeriesRecorder(max_points=4, window_s=0.02)
    run = samples([Step(moved={"remote_to_cpu": 1000})] * 40)
    for index, sample in enumerate(run):
        recorder.on_step(
            replace(
                sample, remote_enabled=True, remote_hit_tokens=16 * index, remote_misses=index // 10
            )
        )
    series = recorder.series()
    assert sum(p.remote_hit_tokens for p in series.points) == 16 * 39
    assert sum(p.remote_misses for p in series.points) == 3
    assert sum(p.bytes_by_direction["remote_to_cpu"] for p in series.points) == 40 * 1000
    again = TimeSeries.from_json(series.to_json())
    assert [p.remote_hit_tokens for p in again.points] == [
        p.remote_hit_tokens for p in series.points
    ]
    # A point written before the remote tier existed reads as none.
    old = {k: v for k, v in series.points[0].to_json().items() if not k.startswith("remote")}
    assert type(series.points[0]).from_json(old).remote_hit_tokens == 0
