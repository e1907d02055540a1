"""/metrics during a real run: scraped over HTTP, parsed with prometheus-client's parser;
the values move as the run goes and agree with the final JSON."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvswap.base.tier import Tier, keyed_tier
from kvswap.base.transfer import direction_between
from kvswap.config_load import load_config
from kvswap.control.metrics import KVMetrics
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.prometheus import PrometheusExporter
from kvswap.obs.watermarks import Watermarks
from kvswap.workload.synthetic import generate_synthetic

from .obs_fakes import TINY_SETTINGS, TINY_SPEC, Step, one_torch_thread, record

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
ROOT = Path(__file__).resolve().parents[2]


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: Scrape, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


class Scraper(StepObserver):
    """Scrapes the exporter's endpoint from inside the run, at the given steps."""

    def __init__(self, url: str, at_steps: tuple[int, ...]):
        self.url, self.at_steps = url, at_steps
        self.scrapes: list[Scrape] = []

    def on_step(self, sample: StepSample) -> None:
        if sample.step in self.at_steps:
            self.scrapes.append(scrape(self.url))


@pytest.fixture(scope="module")
def scraped_run() -> tuple[dict[str, Any], list[Scrape], Scrape]:
    config = load_config(environ={}, overrides=TINY_SETTINGS)
    with one_torch_thread(), Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        exporter = PrometheusExporter(
            block_bytes=engine.layout.block_bytes, block_tokens=8,
            watermarks=Watermarks.from_config(config), kv_metrics=engine.swapper.metrics,
        )  # fmt: skip
        port = exporter.serve("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/metrics"
        scraper = Scraper(url, at_steps=(5, 30, 60))
        try:
            summary = engine.run(
                generate_synthetic(TINY_SPEC), observers=[exporter, scraper]
            ).to_json()
            final = scrape(url)
        finally:
            exporter.close()
    return summary, scraper.scrapes, final


def test_values_move_as_the_run_progresses(scraped_run: tuple[Any, list[Scrape], Scrape]) -> None:
    _, scrapes, final = scraped_run
    assert len(scrapes) == 3
    history = [*scrapes, final]
    for name in ("kvswap_steps_total", "kvswap_generation_tokens_total"):
        values = [value(m, name) for m in history]
        assert values == sorted(values) and values[0] < values[-1], name
    written = [value(m, "kvswap_transfer_bytes_total", direction="gpu_to_cpu") for m in history]
    assert written == sorted(written) and written[-1] > 0
    assert value(scrapes[0], "kvswap_tier_capacity_blocks", tier="gpu") == 12
    assert value(scrapes[0], "kvswap_tier_capacity_bytes", tier="cpu") == 8 * 4096
    assert value(final, "kvswap_tier_watermark_ratio", tier="gpu", watermark="high") == 0.85


def test_the_last_scrape_agrees_with_the_final_json(
    scraped_run: tuple[dict[str, Any], list[Scrape], Scrape],
) -> None:
    summary, _, final = scraped_run
    for direction in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_nvme", "nvme_to_cpu"):
        exported = value(final, "kvswap_transfer_bytes_total", direction=direction)
        assert exported == summary[f"bytes_{direction}"], direction
    assert summary["preemptions"] > 0 and summary["bytes_cpu_to_gpu"] > 0
    for name, key in (
        ("kvswap_preemptions_total", "preemptions"),
        ("kvswap_sync_stalls_total", "sync_stalls"),
        ("kvswap_protected_block_saves_total", "protected_block_saves"),
        ("kvswap_recomputed_tokens_total", "recomputed_tokens"),
        ("kvswap_generation_tokens_total", "tokens_generated"),
        ("kvswap_prefetch_hits_total", "prefetch_hits"),
        ("kvswap_prefetch_misses_total", "prefetch_misses"),
    ):
        assert value(final, name) == summary[key], name
    for reason, count in summary["evictions_by_reason"].items():
        assert value(final, "kvswap_evictions_total", reason=reason) == count
    for tier, tokens in summary["prefix_hit_tokens"].items():
        assert value(final, "kvswap_prefix_hit_tokens_total", tier=tier) == tokens
    # One TTFT per completed request, one per-token latency per later token.
    completed, tokens = summary["requests_completed"], summary["tokens_generated"]
    assert value(final, "kvswap_time_to_first_token_seconds_count") == completed
    assert value(final, "kvswap_time_per_output_token_seconds_count") == tokens - completed
    ratio = value(final, "kvswap_swap_wait_ratio")
    assert ratio == pytest.approx(summary["swap_wait_share"], abs=1e-6)
    assert value(final, "kvswap_pinned_pool_usage_ratio") <= 1.0
    assert value(final, "kvswap_block_size_bytes") == summary["block_bytes"]


def test_synthetic_steps_give_tier_bytes_throughput_and_histograms() -> None:
    exporter = PrometheusExporter(block_bytes=1024, block_tokens=16, watermarks=Watermarks())
    steps = [Step(moved={"gpu_to_cpu": 10**6}, used={"gpu": 90, "cpu": 95}, ttfts_s=(0.2,))] * 50
    record(steps, observers=[exporter])
    metrics = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(exporter.exposition())
        for s in f.samples
    }
    assert value(metrics, "kvswap_tier_used_bytes", tier="gpu") == 90 * 1024
    assert value(metrics, "kvswap_tier_usage_ratio", tier="cpu") == 0.95
    assert value(metrics, "kvswap_pinned_pool_usage_ratio") == 0.95
    # 1 MB per 10 ms step = 100 MB/s over the trailing second.
    throughput = value(metrics, "kvswap_link_throughput_bytes_per_second", direction="gpu_to_cpu")
    assert throughput == pytest.approx(1e8, rel=0.02)
    assert value(metrics, "kvswap_transfer_bytes_total", direction="gpu_to_cpu") == 50 * 10**6
    assert value(metrics, "kvswap_time_to_first_token_seconds_count") == 50
    assert value(metrics, "kvswap_time_to_first_token_seconds_bucket", le="0.25") == 50
    assert value(metrics, "kvswap_time_to_first_token_seconds_bucket", le="0.1") == 0
    exporter.on_finish({"bytes_gpu_to_cpu": 51 * 10**6, "preemptions": 3})
    after = exporter.exposition()
    assert 'kvswap_transfer_bytes_total{direction="gpu_to_cpu"} 5.1e+07' in after
    assert "kvswap_preemptions_total 3.0" in after


def test_a_port_in_use_is_a_one_line_user_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = PrometheusExporter(block_bytes=1, block_tokens=1, watermarks=Watermarks())
        with pytest.raises(KvSwapError, match=f"--metrics-port {port}: cannot listen"):
            exporter.serve("127.0.0.1", port)


def test_every_metric_in_the_grafana_dashboard_is_exported() -> None:
    dashboard = json.loads((ROOT / "dashboards/grafana-kvswap.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert titles[0].startswith("Link throughput") and titles[1].startswith("Swap-wait share")
    assert titles[2].startswith("Token latency P50 / P95 / P99")
    assert titles[3].startswith("Pinned pool utilisation")
    exporter = PrometheusExporter(block_bytes=1, block_tokens=1, watermarks=Watermarks())
    record([Step(moved={"gpu_to_cpu": 1}, ttfts_s=(0.1,))] * 3, observers=[exporter])
    families = {f.name: f.type for f in text_string_to_metric_families(exporter.exposition())}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {
        name + suffix for name, kind in families.items() for suffix in suffixes.get(kind, ("",))
    }
    used = {
        word
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for word in target["expr"].replace("(", " ").replace("{", " ").split()
        if word.startswith("kvswap_")
    }
    assert used and used <= exported, used - exported


def test_the_remote_tier_is_exported_live_and_brought_up_to_the_summary() -> None:
    kv = KVMetrics()
    store_counters = {"outages": 0, "corrupt": 0}
    exporter = PrometheusExporter(
        block_bytes=64, block_tokens=16, watermarks=Watermarks(), kv_metrics=kv,
        remote_counters=lambda: store_counters,
    )  # fmt: skip

    def scrape_now() -> Scrape:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(exporter.exposition())
            for s in f.samples
        }

    # Every remote series exists at 0 from the first scrape.
    first = scrape_now()
    assert value(first, "kvswap_remote_lookup_blocks_total", result="hit") == 0
    assert value(first, "kvswap_transfer_bytes_total", direction="remote_to_cpu") == 0
    assert value(first, "kvswap_prefix_hit_tokens_total", tier="remote") == 0
    assert value(first, "kvswap_remote_store_events_total", event="reconnect") == 0
    kv.remote_lookups, kv.remote_lookup_blocks, kv.remote_found_blocks = 3, 10, 4
    kv.remote_lookup_misses, kv.remote_fetch_failures = 1, 1
    kv.remote_writes, kv.remote_write_failures, kv.remote_writes_skipped = 6, 1, 2
    kv.prefix_hit_blocks_by_tier[Tier.REMOTE] = 4
    store_counters["outages"] = store_counters["reconnects"] = 1
    steps = [Step(moved={"remote_to_cpu": 256, "cpu_to_remote": 64})] * 2
    record(steps, observers=[exporter])
    live = scrape_now()
    assert value(live, "kvswap_remote_lookups_total") == 3
    assert value(live, "kvswap_remote_lookup_blocks_total", result="hit") == 4
    assert value(live, "kvswap_remote_lookup_blocks_total", result="miss") == 6
    assert value(live, "kvswap_remote_misses_total", kind="fetch") == 1
    assert value(live, "kvswap_remote_writes_total", result="skipped") == 2
    assert value(live, "kvswap_prefix_hit_tokens_total", tier="remote") == 64
    assert value(live, "kvswap_transfer_bytes_total", direction="remote_to_cpu") == 512
    assert value(live, "kvswap_remote_store_events_total", event="outage") == 1
    assert value(live, "kvswap_remote_store_events_total", event="reconnect") == 1
    # The summary's remote object has the last word (the data plane's final counters).
    exporter.on_finish({"remote": {"writes": 7, "corrupt": 2, "outages": 1}})
    final = scrape_now()
    assert value(final, "kvswap_remote_writes_total", result="written") == 7
    assert value(final, "kvswap_remote_store_events_total", event="corrupt") == 2


def test_a_keyed_tier_past_the_first_is_exported_under_its_own_name() -> None:
    """A tier of one's own below the store (`remote2`): its hits, bytes and transfers
    are series of their own, live and in the final figures."""
    kv = KVMetrics(keyed_tiers=(keyed_tier(0), keyed_tier(1)))
    exporter = PrometheusExporter(
        block_bytes=64, block_tokens=16, watermarks=Watermarks(), kv_metrics=kv
    )
    kv.prefix_hit_blocks_by_tier[keyed_tier(1)] = 2
    kv.record_transfer(direction_between(keyed_tier(1), Tier.CPU), 128, 0.001)
    record([Step(moved={"remote2_to_cpu": 128})], observers=[exporter])
    live = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(exporter.exposition())
        for s in f.samples
    }
    assert value(live, "kvswap_prefix_hit_tokens_total", tier="remote2") == 32
    assert value(live, "kvswap_transfers_total", direction="remote2_to_cpu") == 1
    assert value(live, "kvswap_transfer_bytes_total", direction="remote2_to_cpu") == 128
