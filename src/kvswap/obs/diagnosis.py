"""The seed article's diagnosis, automated: which of the four numbers says what is wrong.

Pure functions over a run summary (the --json object) and its `TimeSeries`.
Each rule returns a `Finding` naming the metric and the figure behind it, or
None when the run does not show the symptom. The rules and their terms:

* "early" and "late" are the first and the last third of the run's duration;
  a phase's P50/P99 come from the token latencies emitted in the windows whose
  midpoint falls in it. A phase with fewer than `min_phase_tokens` latencies
  gives no verdict.
* A percentile is *rising* when late >= `rising_ratio` x early (1.5x), and
  *holds* when late < `holding_ratio` x early (1.2x).
* A value is above a threshold *for long* when the longest run of consecutive
  time-series windows above it lasts at least `sustained_share` (20%) of the
  run's duration and spans at least `min_sustained_windows` (3) windows, so a
  single burst does not count.

1. P99 rising while P50 holds -> swap-in stalls (only if the run swapped in).
2. P50 and P99 rising together -> the link is saturated (only if KV moved).
3. GPU->CPU (write) throughput above 60% of the link for long -> too much
   swap-out. The link is `link_gb_per_s`, else the summary's `link_gb_per_s`, else the
   article's PCIe 4.0 x16 figure (25 GB/s); the finding states which.
4. Swap-wait share of step time above 10% over the run -> prefetch or eviction
   is wrong.
5. Pinned pool (CPU tier) occupancy above 90% for long -> add or enlarge NVMe.
6. P99 at least `tail_ratio` (2x) the P50 over the whole run, in a run that swapped in
   -> the tail by cause (obs/tail.py): which steps the tokens at or above P99 came
   from. At least `tail_cause_share` (half) of them from steps that waited for a
   swap-in or had a sync stall: swap-in blocking; from steps that also computed a
   prefill chunk: prefill, not swap-in; neither half held: the split. Silent when
   plain decode steps hold half the tail (uniformly slow steps, or sequences paused
   between tokens: rules 1 and 2 and the preemption count speak to those). Rule 1
   sees the tail grow over time; this one says who is in it, growing or not.
7. With a remote tier: more than `remote_failure_share` (10%) of the blocks found in
   the store (at least `min_remote_blocks` of them) failed to arrive and were
   recomputed -> the store loses keys it reported, returns bad values or is down.
8. Any request refused at admission (it could never run: longer than the GPU tier
   holds, or past the model's positions) -> the tiers are sized for shorter requests;
   the finding names the blocks the longest refused request needs.
9. With a remote tier: the store was unreachable at least once (an outage) -> the
   remote tier was off meanwhile (every lookup a miss, finished prefixes not written).
10. At least `queue_share` (half) of the time to first token was spent waiting for
   admission, and the median wait is at least `min_queue_wait_ms` (1 s) -> the engine
   was over capacity: requests queued, however healthy the running ones' latencies.

Every percentile a finding quotes is the summary's own (`itl_ms`), so a finding
never disagrees with the table above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvswap.ledger import DEFAULT_LINK_GB_PER_S
from kvswap.obs.diagnosis_requests import (
    remote_fetches_failing,
    remote_store_down,
    requests_queued,
    requests_refused,
)
from kvswap.obs.finding import Finding, Thresholds
from kvswap.obs.jsonvalues import int_map, number, number_or
from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.tail import DECODE, PREFILL, SWAP_WAIT, TailAttribution
from kvswap.obs.timeseries import SeriesPoint, TimeSeries

STALL_CAUSE = "some decode steps wait for swap-ins (a stall in the tail, not a slower link)"
STALL_ADVICE = (
    "prefetch resuming sequences earlier (prefetch_stream_count), keep swap-out chunks small "
    "(swap_out_chunk_blocks) so swap-ins do not queue behind them, and check sync_stalls"
)
LINK_CAUSE = "the host<->device link is saturated: every step waits for KV traffic"
LINK_ADVICE = (
    "move less KV: more GPU KV capacity, fewer concurrent sequences (max_num_seqs), or a "
    "faster link; compare link throughput with kvswap bench"
)


@dataclass(frozen=True)
class LatencyTrend:
    early_p50_ms: float
    early_p99_ms: float
    late_p50_ms: float
    late_p99_ms: float

    @property
    def p50_ratio(self) -> float:
        return self.late_p50_ms / self.early_p50_ms if self.early_p50_ms > 0 else 1.0

    @property
    def p99_ratio(self) -> float:
        return self.late_p99_ms / self.early_p99_ms if self.early_p99_ms > 0 else 1.0

    def figure(self) -> str:
        return (
            f"token latency P99 {self.early_p99_ms:.1f} -> {self.late_p99_ms:.1f} ms "
            f"(x{self.p99_ratio:.2f}), P50 {self.early_p50_ms:.1f} -> {self.late_p50_ms:.1f} ms "
            f"(x{self.p50_ratio:.2f}), first vs last third of the run"
        )

    def values(self) -> dict[str, float]:
        return {
            "early_p50_ms": self.early_p50_ms,
            "early_p99_ms": self.early_p99_ms,
            "late_p50_ms": self.late_p50_ms,
            "late_p99_ms": self.late_p99_ms,
        }


@dataclass(frozen=True)
class Stretch:
    """Where a per-window value exceeded a threshold."""

    longest_s: float  # the longest run of consecutive windows above it
    longest_windows: int
    duration_s: float  # the whole series
    peak: float

    @property
    def share(self) -> float:
        return self.longest_s / self.duration_s if self.duration_s > 0 else 0.0

    def is_long(self, thresholds: Thresholds) -> bool:
        return (
            self.longest_windows >= thresholds.min_sustained_windows
            and self.share >= thresholds.sustained_share
        )


def latency_trend(series: TimeSeries, min_phase_tokens: int = 20) -> LatencyTrend | None:
    """Token latency percentiles of the first vs the last third of the run."""
    if not series.points:
        return None
    start_s, duration_s = series.points[0].start_s, series.duration_s
    early = [p.itl for p in series.points if p.mid_s < start_s + duration_s / 3]
    late = [p.itl for p in series.points if p.mid_s >= start_s + 2 * duration_s / 3]
    early_hist, late_hist = LogHistogram().merged(*early), LogHistogram().merged(*late)
    if min(early_hist.count, late_hist.count) < max(1, min_phase_tokens):
        return None
    values = [h.quantile_ms(q) for h in (early_hist, late_hist) for q in (0.50, 0.99)]
    e50, e99, l50, l99 = (v if v is not None else 0.0 for v in values)
    return LatencyTrend(e50, e99, l50, l99)


def longest_stretch(
    points: Sequence[SeriesPoint], value: Callable[[SeriesPoint], float], threshold: float
) -> Stretch:
    longest_s = current_s = 0.0
    longest_n = current_n = 0
    for point in points:
        if value(point) > threshold:
            current_s += point.duration_s
            current_n += 1
            if current_s > longest_s:
                longest_s, longest_n = current_s, current_n
        else:
            current_s, current_n = 0.0, 0
    duration_s = points[-1].end_s - points[0].start_s if points else 0.0
    peak = max((value(p) for p in points), default=0.0)
    return Stretch(longest_s, longest_n, duration_s, peak)


def swap_in_stalls(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    trend = latency_trend(series, t.min_phase_tokens)
    swapped_in = number_or(summary, "bytes_cpu_to_gpu") + number_or(summary, "bytes_nvme_to_cpu")
    if trend is None or swapped_in <= 0:
        return None
    if not (trend.p99_ratio >= t.rising_ratio and trend.p50_ratio < t.holding_ratio):
        return None
    return Finding(
        rule="swap_in_stalls",
        symptom="P99 token latency rising while P50 holds",
        metric="kvswap_time_per_output_token_seconds (itl_ms)",
        figure=trend.figure(),
        cause=STALL_CAUSE,
        advice=STALL_ADVICE,
        values={**trend.values(), "sync_stalls": number_or(summary, "sync_stalls")},
    )


def link_saturated(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    trend = latency_trend(series, t.min_phase_tokens)
    moved = sum(
        number_or(summary, f"bytes_{d}")
        for d in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_nvme", "nvme_to_cpu")
    )
    if trend is None or moved <= 0:
        return None
    if not (trend.p99_ratio >= t.rising_ratio and trend.p50_ratio >= t.rising_ratio):
        return None
    return Finding(
        rule="link_saturated",
        symptom="P50 and P99 token latency rising together",
        metric="kvswap_time_per_output_token_seconds (itl_ms)",
        figure=trend.figure(),
        cause=LINK_CAUSE,
        advice=LINK_ADVICE,
        values=trend.values(),
    )


def resolve_link_gb_per_s(
    summary: Mapping[str, object], link_gb_per_s: float | None
) -> tuple[float, str]:
    """(GB/s, where it came from): the argument, the summary's `link_gb_per_s`, or the default."""
    if link_gb_per_s is not None:
        return link_gb_per_s, "given"
    from_summary = number(summary, "link_gb_per_s")
    if from_summary is not None and from_summary > 0:
        return from_summary, "the run's hardware"
    return DEFAULT_LINK_GB_PER_S, "the seed article's PCIe 4.0 x16 figure; pass the measured link"


def too_much_swap_out(
    summary: Mapping[str, object],
    series: TimeSeries,
    t: Thresholds = Thresholds(),
    link_gb_per_s: float | None = None,
) -> Finding | None:
    link, source = resolve_link_gb_per_s(summary, link_gb_per_s)
    limit_gb_per_s = t.write_link_share * link
    stretch = longest_stretch(series.points, lambda p: p.gb_per_s("gpu_to_cpu"), limit_gb_per_s)
    if not stretch.is_long(t):
        return None
    return Finding(
        rule="too_much_swap_out",
        symptom=f"write throughput above {100 * t.write_link_share:.0f}% of the link for long",
        metric='kvswap_transfer_bytes_total{direction="gpu_to_cpu"} (rate)',
        figure=f"GPU->CPU above {limit_gb_per_s:.2f} GB/s ({100 * t.write_link_share:.0f}% of "
        f"{link:.1f} GB/s, {source}) for {stretch.longest_s:.2f} s of {stretch.duration_s:.2f} s "
        f"({100 * stretch.share:.0f}%), peak {stretch.peak:.2f} GB/s",
        cause="too much swap-out: the GPU tier keeps overflowing",
        advice="raise GPU KV capacity (gpu_kv_capacity_blocks) or swap_out_high_watermark",
        values={
            "link_gb_per_s": link,
            "limit_gb_per_s": limit_gb_per_s,
            "peak_gb_per_s": stretch.peak,
            "above_s": stretch.longest_s,
            "duration_s": stretch.duration_s,
        },
    )


def swap_wait_high(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    share = number_or(summary, "swap_wait_share")
    if share <= t.swap_wait_share:
        return None
    return Finding(
        rule="swap_wait_high",
        symptom=f"swap-wait share above {100 * t.swap_wait_share:.0f}% of decode time",
        metric="kvswap_swap_wait_ratio (swap_wait_share)",
        figure=f"steps waited on swap-in for {100 * share:.1f}% of step time "
        f"({number_or(summary, 'swap_wait_s'):.3f} s)",
        cause="prefetch or eviction is wrong: blocks the next step needs were not on the GPU",
        advice="prefetch earlier (prefetch_stream_count, swap_in_chunk_blocks) and keep hot "
        "blocks resident (min_residency_steps, evict_protected_blocks)",
        values={"swap_wait_share": share, "swap_wait_s": number_or(summary, "swap_wait_s")},
    )


def pinned_pool_full(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    if not any(p.capacity_blocks_by_tier.get("cpu", 0) for p in series.points):
        return None
    stretch = longest_stretch(
        series.points, lambda p: p.usage_mean_by_tier.get("cpu", 0.0), t.pinned_pool_usage
    )
    if not stretch.is_long(t):
        return None
    has_nvme = int_map(summary, "capacity_blocks_by_tier").get("nvme", 0) > 0
    return Finding(
        rule="pinned_pool_full",
        symptom=f"pinned pool above {100 * t.pinned_pool_usage:.0f}% for long",
        metric="kvswap_pinned_pool_usage_ratio (pinned_pool_utilization_peak)",
        figure=f"CPU tier above {100 * t.pinned_pool_usage:.0f}% for {stretch.longest_s:.2f} s "
        f"of {stretch.duration_s:.2f} s ({100 * stretch.share:.0f}%), "
        f"peak {100 * stretch.peak:.0f}%",
        cause="cold KV has nowhere to go but away: the pinned pool is the last tier in use",
        advice=(
            "enlarge the NVMe tier (nvme_kv_capacity_blocks) or lower cpu_demote_high_watermark"
            if has_nvme
            else "add an NVMe tier (nvme_dir, nvme_kv_capacity_blocks) so cold blocks demote"
        ),
        values={"peak_usage": stretch.peak, "above_s": stretch.longest_s},
    )


#: Rule 6 per class of step holding the tail: (cause, advice).
TAIL_CAUSES: dict[str, tuple[str, str]] = {
    SWAP_WAIT: (
        "swap-in blocking: the slowest tokens come from steps that waited for a swap-in "
        "or stalled on a synchronous swap-out",
        STALL_ADVICE,
    ),
    PREFILL: (
        "prefill chunks, not swap-ins: the slowest tokens come from decode steps that also "
        "computed a prompt chunk",
        "lower max_num_batched_tokens so a prompt chunk stretches each decode step less",
    ),
}
TAIL_MIXED = (
    "no single cause: the slowest tokens split between swap waits, prefill chunks and "
    "plain decode steps",
    "address the largest share first (swap waits: prefetch_stream_count, "
    "swap_out_chunk_blocks; prefill chunks: max_num_batched_tokens)",
)


def tail_figure(a: TailAttribution) -> str:
    with_ms, without_ms = a.p99_ms_with_swap_wait, a.p99_ms_without_swap_wait
    return (
        f"of {a.num_tail_tokens} tokens at or above P99 {a.p99_ms:.1f} ms "
        f"({a.tail_ratio:.1f}x P50 {a.p50_ms:.1f} ms): "
        f"{100 * a.share_of_tail(SWAP_WAIT):.0f}% from steps that waited for a swap-in or "
        f"stalled ({100 * a.share_of_tokens(SWAP_WAIT):.0f}% of all tokens), "
        f"{100 * a.share_of_tail(PREFILL):.0f}% from steps with a prefill chunk, "
        f"{100 * a.share_of_tail(DECODE):.0f}% from plain decode steps; P99 "
        + (f"{with_ms:.1f} ms" if with_ms is not None else "n/a")
        + " with a swap wait vs "
        + (f"{without_ms:.1f} ms" if without_ms is not None else "n/a")
        + " without"
    )


def summary_percentiles_ms(summary: Mapping[str, object]) -> tuple[float, float] | None:
    """The run's token-latency (P50, P99) as its summary states them (`itl_ms`)."""
    p50, p99 = number(summary, "itl_ms", "p50"), number(summary, "itl_ms", "p99")
    return None if p50 is None or p99 is None else (p50, p99)


def tail_summary(
    series: TimeSeries, summary: Mapping[str, object] | None = None
) -> dict[str, object] | None:
    """The summary's `tail_attribution` object (`TailAttribution.to_json`), read at the
    summary's own P50/P99; None when the series holds no per-step classes or no token
    latency."""
    percentiles = summary_percentiles_ms(summary) if summary is not None else None
    attribution = series.tail.attribution(percentiles) if series.tail is not None else None
    return attribution.to_json() if attribution is not None else None


def tail_attribution(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    swapped_in = number_or(summary, "bytes_cpu_to_gpu") + number_or(summary, "bytes_nvme_to_cpu")
    percentiles = summary_percentiles_ms(summary)
    attribution = series.tail.attribution(percentiles) if series.tail is not None else None
    if attribution is None or swapped_in <= 0:
        return None
    a = attribution
    if a.num_tail_tokens < max(1, t.min_tail_tokens) or a.tail_ratio < t.tail_ratio:
        return None
    if a.share_of_tail(DECODE) >= t.tail_cause_share:
        return None  # slow steps that neither waited nor prefilled: rules 1 and 2 speak
    leader = max((SWAP_WAIT, PREFILL), key=a.share_of_tail)
    held = a.share_of_tail(leader) >= t.tail_cause_share
    cause, advice = TAIL_CAUSES[leader] if held else TAIL_MIXED
    values = {
        "share_of_tail_tokens_waiting": a.share_of_tail_tokens_waiting,
        "share_of_tail_tokens_prefill": a.share_of_tail(PREFILL),
        "share_of_tail_tokens_decode": a.share_of_tail(DECODE),
        "share_of_tokens_waiting": a.share_of_tokens(SWAP_WAIT),
        "p50_ms": a.p50_ms,
        "p99_ms": a.p99_ms,
        "num_tail_tokens": float(a.num_tail_tokens),
        "sync_stalls": number_or(summary, "sync_stalls"),
    }
    if a.p99_ms_with_swap_wait is not None:
        values["p99_ms_with_swap_wait"] = a.p99_ms_with_swap_wait
    if a.p99_ms_without_swap_wait is not None:
        values["p99_ms_without_swap_wait"] = a.p99_ms_without_swap_wait
    return Finding(
        rule="tail_attribution",
        symptom=f"P99 token latency at least {t.tail_ratio:g}x P50",
        metric="kvswap_time_per_output_token_seconds (itl_ms, tail_attribution)",
        figure=tail_figure(a),
        cause=cause,
        advice=advice,
        values=values,
    )


def diagnose(
    summary: Mapping[str, object],
    series: TimeSeries,
    *,
    link_gb_per_s: float | None = None,
    thresholds: Thresholds = Thresholds(),
) -> list[Finding]:
    """Every rule that fires, in the seed article's order."""
    found = [
        swap_in_stalls(summary, series, thresholds),
        link_saturated(summary, series, thresholds),
        too_much_swap_out(summary, series, thresholds, link_gb_per_s),
        swap_wait_high(summary, series, thresholds),
        pinned_pool_full(summary, series, thresholds),
        tail_attribution(summary, series, thresholds),
        remote_fetches_failing(summary, series, thresholds),
        requests_refused(summary, series, thresholds),
        remote_store_down(summary, series, thresholds),
        requests_queued(summary, series, thresholds),
    ]
    return [f for f in found if f is not None]


def diagnose_change(
    base: Mapping[str, object], other: Mapping[str, object], t: Thresholds = Thresholds()
) -> Finding | None:
    """Rules 1 and 2 across two runs (e.g. before/after raising the batch): the runs'
    whole token-latency P50/P99 (`itl_ms`) stand in for the early/late phases."""
    values = [number(s, "itl_ms", q) for s in (base, other) for q in ("p50", "p99")]
    if any(v is None or v <= 0 for v in values):
        return None
    e50, e99, l50, l99 = (v or 0.0 for v in values)
    trend = LatencyTrend(e50, e99, l50, l99)
    figure = trend.figure().replace("first vs last third of the run", "first run vs this run")
    if trend.p99_ratio >= t.rising_ratio and trend.p50_ratio < t.holding_ratio:
        return Finding(
            "swap_in_stalls", "P99 token latency up while P50 holds", "itl_ms", figure,
            STALL_CAUSE, STALL_ADVICE, trend.values(),
        )  # fmt: skip
    if trend.p99_ratio >= t.rising_ratio and trend.p50_ratio >= t.rising_ratio:
        return Finding(
            "link_saturated", "P50 and P99 token latency up together", "itl_ms", figure,
            LINK_CAUSE, LINK_ADVICE, trend.values(),
        )  # fmt: skip
    return None
