"""The article's diagnosis: each rule fires on a run built to show its symptom, and no
rule fires on a healthy run (synthetic, and a real one on the tiny model)."""

from __future__ import annotations

from typing import Any

import pytest

from kvswap.config import load_config
from kvswap.engine.engine import Engine, EngineOptions
from kvswap.obs.diagnosis import (
    Finding,
    diagnose,
    diagnose_change,
    latency_trend,
    link_saturated,
    pinned_pool_full,
    swap_in_stalls,
    swap_wait_high,
    too_much_swap_out,
)
from kvswap.obs.timeseries import TimeSeriesRecorder
from kvswap.workload.synthetic import generate_synthetic

from .obs_fakes import TINY_SETTINGS, TINY_SPEC, Step, one_torch_thread, record

# 300 steps of 10 ms: the first and last thirds are steps 0-99 and 200-299.
N = 300
SWAP_IN = {"cpu_to_gpu": 8 * 2**20}  # some swap-in in every step: the link is in play


def healthy() -> list[Step]:
    return [Step(moved=dict(SWAP_IN)) for _ in range(N)]


def rules(found: list[Finding]) -> list[str]:
    return [f.rule for f in found]


def test_a_healthy_run_raises_nothing() -> None:
    summary, series = record(healthy())
    assert diagnose(summary, series, link_gbps=25.0) == []
    trend = latency_trend(series)
    assert trend is not None and trend.p50_ratio == trend.p99_ratio == 1.0


def test_p99_rising_while_p50_holds_is_a_swap_in_stall() -> None:
    steps = healthy()
    for i in range(200, N, 10):  # late: one token in 40 waits 60 ms
        steps[i] = Step(moved=dict(SWAP_IN), latencies_s=(0.01, 0.01, 0.01, 0.06))
    summary, series = record(steps)
    finding = swap_in_stalls(summary, series)
    assert finding is not None
    assert finding.metric.startswith("kvswap_time_per_output_token_seconds")
    # Percentiles come from 2%-wide histogram buckets: within 1% of the exact values.
    assert "P99 10.0 -> 59.9 ms (x5.99)" in finding.figure
    assert "P50 10.0 -> 10.1 ms (x1.01)" in finding.figure
    assert finding.values["late_p99_ms"] == pytest.approx(60.0, rel=0.01)
    assert rules(diagnose(summary, series)) == ["swap_in_stalls"]


def test_p50_and_p99_rising_together_is_a_saturated_link() -> None:
    steps = healthy()
    for i in range(200, N):
        steps[i] = Step(moved=dict(SWAP_IN), latencies_s=(0.025,) * 4)
    summary, series = record(steps)
    finding = link_saturated(summary, series)
    assert finding is not None and "P50 10.0 -> 25.0 ms (x2.50)" in finding.figure
    assert swap_in_stalls(summary, series) is None
    assert rules(diagnose(summary, series)) == ["link_saturated"]


def test_rising_latency_without_kv_traffic_is_not_blamed_on_the_link() -> None:
    steps = [Step(latencies_s=(0.025,) * 4 if i >= 200 else (0.01,) * 4) for i in range(N)]
    summary, series = record(steps)
    assert link_saturated(summary, series) is None and swap_in_stalls(summary, series) is None


def test_too_few_latencies_give_no_verdict() -> None:
    steps = [Step(moved=dict(SWAP_IN), latencies_s=(0.01,) if i < 5 else ()) for i in range(N)]
    summary, series = record(steps)
    assert latency_trend(series) is None
    assert diagnose(summary, series) == []


def write_heavy(first: int, last: int, gbps: float = 0.8) -> list[Step]:
    """Steps first..last-1 move `gbps` GB/s GPU->CPU (10 ms steps)."""
    steps = healthy()
    for i in range(first, last):
        moved = {**SWAP_IN, "gpu_to_cpu": int(gbps * 1e9 * 0.01)}
        steps[i] = Step(moved=moved)
    return steps


def test_write_throughput_above_60_percent_of_the_link_for_long_is_too_much_swap_out() -> None:
    summary, series = record(write_heavy(100, 250))  # half the run at 80% of a 1 GB/s link
    finding = too_much_swap_out(summary, series, link_gbps=1.0)
    assert finding is not None
    assert "above 0.60 GB/s" in finding.figure and "(50%)" in finding.figure
    assert finding.values["peak_gbps"] > 0.6
    assert "gpu_to_cpu" in finding.metric
    assert rules(diagnose(summary, series, link_gbps=1.0)) == ["too_much_swap_out"]
    # The same traffic on the article's 25 GB/s default link is far below 60%.
    assert too_much_swap_out(summary, series) is None
    # The link can come from the run's summary (the simulator's hardware).
    finding = too_much_swap_out({**summary, "link_gbps": 1.0}, series)
    assert finding is not None and "the run's hardware" in finding.figure


def test_a_short_write_burst_is_not_for_long() -> None:
    summary, series = record(write_heavy(100, 120))  # 7% of the run
    assert too_much_swap_out(summary, series, link_gbps=1.0) is None


def test_swap_wait_above_ten_percent_means_prefetch_or_eviction_is_wrong() -> None:
    summary, series = record([Step(moved=dict(SWAP_IN), swap_wait_s=0.0015)] * N)
    finding = swap_wait_high(summary, series)
    assert finding is not None and "15.0% of step time" in finding.figure
    assert finding.metric.startswith("kvswap_swap_wait_ratio")
    summary, series = record([Step(moved=dict(SWAP_IN), swap_wait_s=0.0005)] * N)
    assert swap_wait_high(summary, series) is None


def test_pinned_pool_above_90_percent_for_long_asks_for_nvme() -> None:
    steps = healthy()
    for i in range(150, N):
        steps[i] = Step(moved=dict(SWAP_IN), used={"gpu": 50, "cpu": 95})
    summary, series = record(steps)
    finding = pinned_pool_full(summary, series)
    assert finding is not None and "add an NVMe tier" in finding.advice
    assert "peak 95%" in finding.figure
    assert rules(diagnose(summary, series)) == ["pinned_pool_full"]
    with_nvme = {**summary, "capacity_blocks_by_tier": {"gpu": 100, "cpu": 100, "nvme": 400}}
    finding = pinned_pool_full(with_nvme, series)
    assert finding is not None and "enlarge the NVMe tier" in finding.advice
    # At 85% the pool is busy, not full.
    steps = [Step(moved=dict(SWAP_IN), used={"gpu": 50, "cpu": 85}) for _ in range(N)]
    assert pinned_pool_full(*record(steps)) is None


def test_findings_survive_json() -> None:
    summary, series = record([Step(swap_wait_s=0.005)] * N)
    (finding,) = diagnose(summary, series)
    assert Finding.from_json(finding.to_json()) == finding
    assert finding.symptom in finding.one_line()


def test_comparing_two_runs_applies_the_latency_rules_across_them() -> None:
    base: dict[str, Any] = {"itl_ms": {"p50": 10.0, "p95": 12.0, "p99": 20.0}}
    stalls = {"itl_ms": {"p50": 10.5, "p95": 12.0, "p99": 45.0}}
    saturated = {"itl_ms": {"p50": 20.0, "p95": 30.0, "p99": 40.0}}
    assert (f := diagnose_change(base, stalls)) is not None and f.rule == "swap_in_stalls"
    assert (f := diagnose_change(base, saturated)) is not None and f.rule == "link_saturated"
    assert diagnose_change(base, base) is None
    assert diagnose_change(base, {}) is None


def test_a_real_healthy_run_raises_nothing() -> None:
    """Everything fits on the GPU tier: nothing moves, nothing waits, nothing fires."""
    # No lower tier: the latency rules, which read wall-clock latencies, are then out of
    # play by construction (no KV moved), so the test cannot flake on a busy machine.
    settings = {**TINY_SETTINGS, "gpu_kv_capacity_blocks": 200, "cpu_kv_capacity_blocks": 0}
    config = load_config(environ={}, overrides=settings)
    recorder = TimeSeriesRecorder()
    with one_torch_thread(), Engine(config, EngineOptions(model="tiny")) as engine:
        summary = engine.run(generate_synthetic(TINY_SPEC), observers=[recorder])
    assert summary["preemptions"] == 0 and summary["requests_completed"] == 12
    assert summary["bytes_gpu_to_cpu"] == summary["bytes_cpu_to_gpu"] == 0
    series = recorder.series()
    assert series.points and series.itl.count > 0
    assert diagnose(summary, series) == []
