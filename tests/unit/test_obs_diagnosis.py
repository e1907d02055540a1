"""The article's diagnosis: each rule fires on a run built to show its symptom, and no
rule fires on a healthy run (synthetic, and a real one on the tiny model)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvswap.commands import simulate as simulate_command
from kvswap.config_load import load_config
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.obs.diagnosis import (
    TAIL_CAUSES,
    TAIL_MIXED,
    diagnose,
    diagnose_change,
    latency_trend,
    link_saturated,
    pinned_pool_full,
    swap_in_stalls,
    swap_wait_high,
    tail_attribution,
    too_much_swap_out,
)
from kvswap.obs.diagnosis_requests import remote_fetches_failing, remote_store_down
from kvswap.obs.finding import Finding
from kvswap.obs.observer import StepSample
from kvswap.obs.tail import PREFILL, SWAP_WAIT
from kvswap.obs.timeseries import TimeSeries, TimeSeriesRecorder
from kvswap.workload.synthetic import generate_synthetic

from .obs_fakes import TINY_SETTINGS, TINY_SPEC, Step, one_torch_thread, record, samples

ROOT = Path(__file__).resolve().parents[2]

# 300 steps of 10 ms: the first and last thirds are steps 0-99 and 200-299.
N = 300
SWAP_IN = {"cpu_to_gpu": 8 * 2**20}  # some swap-in in every step: the link is in play


def healthy() -> list[Step]:
    return [Step(moved=dict(SWAP_IN)) for _ in range(N)]


def rules(found: list[Finding]) -> list[str]:
    return [f.rule for f in found]


def test_a_healthy_run_raises_nothing() -> None:
    summary, series = record(healthy())
    assert diagnose(summary, series, link_gb_per_s=25.0) == []
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


def write_heavy(first: int, last: int, gb_per_s: float = 0.8) -> list[Step]:
    """Steps first..last-1 move `gb_per_s` GB/s GPU->CPU (10 ms steps)."""
    steps = healthy()
    for i in range(first, last):
        moved = {**SWAP_IN, "gpu_to_cpu": int(gb_per_s * 1e9 * 0.01)}
        steps[i] = Step(moved=moved)
    return steps


def test_write_throughput_above_60_percent_of_the_link_for_long_is_too_much_swap_out() -> None:
    summary, series = record(write_heavy(100, 250))  # half the run at 80% of a 1 GB/s link
    finding = too_much_swap_out(summary, series, link_gb_per_s=1.0)
    assert finding is not None
    assert "above 0.60 GB/s" in finding.figure and "(50%)" in finding.figure
    assert finding.values["peak_gb_per_s"] > 0.6
    assert "gpu_to_cpu" in finding.metric
    assert rules(diagnose(summary, series, link_gb_per_s=1.0)) == ["too_much_swap_out"]
    # The same traffic on the article's 25 GB/s default link is far below 60%.
    assert too_much_swap_out(summary, series) is None
    # The link can come from the run's summary (the simulator's hardware).
    finding = too_much_swap_out({**summary, "link_gb_per_s": 1.0}, series)
    assert finding is not None and "the run's hardware" in finding.figure


def test_a_short_write_burst_is_not_for_long() -> None:
    summary, series = record(write_heavy(100, 120))  # 7% of the run
    assert too_much_swap_out(summary, series, link_gb_per_s=1.0) is None


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
    with one_torch_thread(), Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        result = engine.run(generate_synthetic(TINY_SPEC), observers=[recorder])
    summary = result.to_json()  # the --json object the diagnosis reads
    assert summary["preemptions"] == 0 and summary["requests_completed"] == 12
    assert summary["bytes_gpu_to_cpu"] == summary["bytes_cpu_to_gpu"] == 0
    series = recorder.series()
    assert series.points and series.itl.count > 0
    assert diagnose(summary, series) == []


# ----------------------------------------------------------- rule 6: the tail by cause
# 300 steps emitting 4 tokens each; every 20th step is slow (60 ms): its 60 tokens are 5%
# of the run, so they are the tail and the run's P99 is 60 ms against a 10 ms P50.
SLOW_STEPS = range(0, N, 20)


def slow_step(swap_wait_s: float = 0.0) -> Step:
    return Step(step_s=0.06, swap_wait_s=swap_wait_s, moved=dict(SWAP_IN), latencies_s=(0.06,) * 4)


def tail_run(
    slow: Callable[[int], Step], mark: Callable[[int, StepSample], StepSample] | None = None
) -> tuple[dict[str, Any], TimeSeries]:
    """(summary, series) of the healthy run with SLOW_STEPS replaced by `slow(i)`; `mark`
    edits the samples (prefill tokens, sync stalls) the series is recorded from."""
    steps = healthy()
    for i in SLOW_STEPS:
        steps[i] = slow(i)
    summary, _ = record(steps)
    recorder = TimeSeriesRecorder()
    for i, sample in enumerate(samples(steps)):
        recorder.on_step(mark(i, sample) if mark is not None else sample)
    return summary, recorder.series()


def test_a_tail_from_steps_that_waited_for_swap_in_is_swap_in_blocking() -> None:
    # 10 ms of each slow step waits: 4% of step time, below rule 4's 10%.
    summary, series = tail_run(lambda i: slow_step(swap_wait_s=0.01))
    finding = tail_attribution(summary, series)
    assert finding is not None and finding.cause == TAIL_CAUSES[SWAP_WAIT][0]
    # The percentiles quoted are the summary's own (`itl_ms`), not the histograms'
    # approximations (59.9 and 10.1 ms): a finding never disagrees with the table.
    assert (summary["itl_ms"]["p99"], summary["itl_ms"]["p50"]) == (60.0, 10.0)
    assert finding.figure.startswith("of 60 tokens at or above P99 60.0 ms (6.0x P50 10.0 ms)")
    assert "100% from steps that waited for a swap-in or stalled (5% of all tokens)" in (
        finding.figure
    )
    # One latency value per class: the histograms' exact extremes make these exact.
    assert "P99 60.0 ms with a swap wait vs 10.0 ms without" in finding.figure
    assert finding.values["share_of_tail_tokens_waiting"] == 1.0
    assert finding.values["p99_ms_with_swap_wait"] == 60.0
    assert finding.values["p99_ms_without_swap_wait"] == 10.0
    assert rules(diagnose(summary, series)) == ["tail_attribution"]


def test_a_sync_stall_counts_as_waiting_even_without_swap_wait_seconds() -> None:
    def stalls(i: int, sample: StepSample) -> StepSample:
        # Cumulative, as drivers report it: one more stall at every slow step.
        return replace(sample, sync_stalls=sum(1 for s in SLOW_STEPS if s <= i))

    summary, series = tail_run(lambda i: slow_step(), stalls)
    finding = tail_attribution(summary, series)
    assert finding is not None and finding.values["share_of_tail_tokens_waiting"] == 1.0
    assert series.tail is not None and series.tail.num_steps_by_class[SWAP_WAIT] == 15


def test_a_tail_from_prefill_chunks_is_not_blamed_on_swap_in() -> None:
    def prefill(i: int, sample: StepSample) -> StepSample:
        return replace(sample, num_prefill_tokens=2048 if i in SLOW_STEPS else 0)

    summary, series = tail_run(lambda i: slow_step(), prefill)
    finding = tail_attribution(summary, series)
    assert finding is not None and finding.cause == TAIL_CAUSES[PREFILL][0]
    assert "0% from steps that waited" in finding.figure
    assert "100% from steps with a prefill chunk" in finding.figure
    assert "P99 n/a with a swap wait vs 59.9 ms without" in finding.figure
    assert "p99_ms_with_swap_wait" not in finding.values
    assert "max_num_batched_tokens" in finding.advice


def test_a_tail_split_between_causes_names_the_split() -> None:
    slow = list(SLOW_STEPS)  # 6 steps wait, 5 prefill, 4 are just slow

    def prefill(i: int, sample: StepSample) -> StepSample:
        return replace(sample, num_prefill_tokens=512 if i in slow[6:11] else 0)

    summary, series = tail_run(lambda i: slow_step(0.01 if i in slow[:6] else 0.0), prefill)
    finding = tail_attribution(summary, series)
    assert finding is not None and finding.cause == TAIL_MIXED[0]
    assert "40% from steps that waited" in finding.figure and "27% from plain" in finding.figure


def test_the_tail_rule_is_silent_without_a_tail_without_swap_in_or_on_plain_slow_steps() -> None:
    assert tail_attribution(*record(healthy())) is None  # P99 = P50
    no_swap_in = [Step(step_s=0.06, latencies_s=(0.06,) * 4) if i in SLOW_STEPS else Step()
                  for i in range(N)]  # fmt: skip
    assert tail_attribution(*record(no_swap_in)) is None
    # Slow steps that neither waited nor prefilled: not this rule's to explain.
    assert tail_attribution(*tail_run(lambda i: slow_step())) is None
    # A series read from an older report carries no per-step classes.
    summary, series = tail_run(lambda i: slow_step(swap_wait_s=0.01))
    old = series.to_json()
    del old["tail_latencies"]
    assert tail_attribution(summary, TimeSeries.from_json(old)) is None
    assert tail_attribution(summary, TimeSeries.from_json(series.to_json())) is not None


# The article's configuration on a shortened workload (24 two-turn sessions of 100
# output tokens instead of 64 x 3 x 200): it still swaps and keeps its tail.
ARTICLE = [
    "simulate", "--config", str(ROOT / "configs" / "article-8b-40gb.toml"),
    "--hardware", "article-40gb", "--num-sessions", "24", "--turns", "2",
    "--output-tokens", "100", "--json", "--quiet",
]  # fmt: skip


def simulate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="kvswap")
    simulate_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    summary: dict[str, Any] = json.loads(capsys.readouterr().out)
    return summary


def test_the_article_configuration_has_a_tail_and_the_diagnosis_names_its_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary = simulate(ARTICLE, capsys)
    assert summary["itl_ms"]["p99"] > 5 * summary["itl_ms"]["p50"]  # the symptom
    assert summary["bytes_cpu_to_gpu"] > 0  # it swapped in
    (finding,) = [f for f in summary["diagnosis"] if f["rule"] == "tail_attribution"]
    values = finding["values"]
    assert {"share_of_tail_tokens_waiting", "p99_ms_with_swap_wait",
            "p99_ms_without_swap_wait"} <= set(values)  # fmt: skip
    assert "at or above P99" in finding["figure"] and "with a swap wait vs" in finding["figure"]
    # What the per-step facts say about this configuration: its ~200 ms tokens come from
    # decode steps sharing the step with a 2048-token prefill chunk, not from swap-ins.
    assert values["share_of_tail_tokens_prefill"] >= 0.5
    assert finding["cause"] == TAIL_CAUSES[PREFILL][0]


def test_the_article_configuration_with_small_prefill_chunks_has_no_tail_to_explain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The finding's advice applied: P99 within 2x P50 although the run still swaps in."""
    summary = simulate([*ARTICLE, "--max-num-batched-tokens", "128"], capsys)
    assert summary["bytes_cpu_to_gpu"] > 0
    assert summary["itl_ms"]["p99"] < 2 * summary["itl_ms"]["p50"]
    assert "tail_attribution" not in [f["rule"] for f in summary["diagnosis"]]


def test_remote_hits_that_fail_to_arrive_are_named_with_the_stores_counters() -> None:
    summary, series = record(healthy())
    assert "remote_fetches_failing" not in rules(diagnose(summary, series, link_gb_per_s=25.0))
    summary["remote"] = {"found_blocks": 40, "fetch_failures": 3, "outages": 1, "corrupt": 0}
    assert remote_fetches_failing(summary, series) is None  # 7.5 %: within the 10 %
    summary["remote"] = {"found_blocks": 40, "fetch_failures": 12, "outages": 2, "corrupt": 1}
    finding = remote_fetches_failing(summary, series)
    assert finding is not None and finding.rule in rules(diagnose(summary, series))
    assert "12 of 40 blocks" in finding.figure and "2 outages" in finding.figure
    assert finding.values["share"] == pytest.approx(0.3)
    summary["remote"] = {"found_blocks": 4, "fetch_failures": 4}
    assert remote_fetches_failing(summary, series) is None  # too few to judge


def test_a_remote_store_that_was_down_is_named_even_with_nothing_found() -> None:
    """Unreachable from the start: no lookup ever found a block, so rule 7 is silent;
    the outage and the writes it cost are still a finding."""
    summary, series = record(healthy())
    assert remote_store_down(summary, series) is None  # no remote tier
    summary["remote"] = {"outages": 0, "writes": 12, "lookups": 5}
    assert remote_store_down(summary, series) is None
    summary["remote"] = {"outages": 1, "writes": 0, "writes_skipped": 11, "lookups": 0}
    finding = remote_store_down(summary, series)
    assert finding is not None and finding.rule in rules(diagnose(summary, series))
    assert finding.figure == "1 outage; 0 blocks written, 11 writes skipped, 0 lookups"
    assert "remote_fetches_failing" not in rules(diagnose(summary, series))


# ----------------------------------------------------------- rule 10: requests queued


def test_requests_that_mostly_waited_for_admission_are_queueing_not_healthy() -> None:
    """Issue 33: a report was green while every request waited ~12 s for its first token."""
    _, series = record(healthy())
    queued = {"queue_share_of_ttft": 0.97, "queue_wait_ms": {"p50": 11_800.0},
              "ttft_ms": {"p50": 12_100.0}}  # fmt: skip
    (finding,) = [f for f in diagnose(queued, series) if f.rule == "requests_queued"]
    assert "97% of the time to first token was queueing" in finding.symptom
    assert "queue wait P50 11800 ms of a TTFT P50 12100 ms" in finding.figure
    assert "max_num_seqs" in finding.advice
    short = {**queued, "queue_wait_ms": {"p50": 400.0}}  # a short queue: no verdict
    brief = {**queued, "queue_share_of_ttft": 0.2}  # compute, not the queue
    for summary in (short, brief):
        assert "requests_queued" not in rules(diagnose(summary, series))


def test_an_overloaded_simulated_engine_is_diagnosed_as_queueing() -> None:
    """Every request of a burst arrives at once and the engine runs two at a time: most
    of their time to first token is the queue, as the run's own figures say."""
    from kvswap.sim.hardware import hardware_preset
    from kvswap.sim.simulator import Simulator
    from kvswap.workload.synthetic import SyntheticSpec

    config = load_config(None, overrides={
        "kv_block_tokens": 16, "gpu_kv_capacity_blocks": 400, "cpu_kv_capacity_blocks": 0,
        "max_num_seqs": 2,
    })  # fmt: skip
    burst = generate_synthetic(SyntheticSpec(
        num_sessions=64, turns_per_session=1, prompt_tokens=2000, output_tokens=200,
        user_tokens_per_turn=1, system_prompt_tokens=0, arrival_rate_per_s=1000.0, seed=1,
    ))  # fmt: skip
    recorder = TimeSeriesRecorder()
    summary = Simulator(config, hardware_preset("article-40gb")).run(burst, observers=[recorder])
    figures = summary.to_json()
    assert figures["queue_share_of_ttft"] > 0.9  # type: ignore[operator]
    assert "requests_queued" in rules(diagnose(figures, recorder.series()))
