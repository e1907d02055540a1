"""Prometheus exporter: every step's sample as `kvswap_*` metrics on a private registry.

`PrometheusExporter` is a `StepObserver`; `serve(host, port)` starts
prometheus-client's HTTP server (a daemon thread) on 127.0.0.1 unless told
otherwise; `close()` stops it. The registry is private, so two exporters (two
engines in one process, or tests) never collide and nothing global leaks in.

Names are in base units with the usual suffixes; labels `direction`
(gpu_to_cpu, cpu_to_gpu, cpu_to_nvme, nvme_to_cpu, cpu_to_remote,
remote_to_cpu), `tier` (gpu, cpu, nvme, remote), `reason`, `watermark` (high,
low). The remote store has no slots: its tier's capacity series read 0 and
`kvswap_remote_known_blocks` counts the blocks this process knows it holds.
Where vLLM or LMCache export the same quantity, the name follows theirs so a
dashboard ports by renaming the prefix:

    kvswap                                     vLLM / LMCache
    kvswap_transfer_bytes_total{direction}     vllm:kv_offload_total_bytes_total{transfer_type}
      {direction="remote_to_cpu"} / "cpu_to_remote"  lmcache:num_remote_read_bytes / _write_bytes
    kvswap_transfer_seconds_total{direction}   vllm:kv_offload_total_time_total{transfer_type}
    kvswap_transfers_total{direction}          lmcache:num_store_requests / num_retrieve_requests
    kvswap_link_throughput_bytes_per_second    (none; rate() of the bytes counter)
    kvswap_swap_wait_seconds_total             (none)
    kvswap_step_seconds_total, kvswap_steps_total
    kvswap_swap_wait_ratio                     (none; summary swap_wait_share)
    kvswap_time_to_first_token_seconds         vllm:time_to_first_token_seconds
    kvswap_time_per_output_token_seconds       vllm:time_per_output_token_seconds (v0: one
                                               observation per output token after the first),
                                               = vllm:inter_token_latency_seconds (v1)
    kvswap_tier_usage_ratio{tier}              vllm:kv_cache_usage_perc (v1),
                                               vllm:gpu_cache_usage_perc / cpu_cache_usage_perc
                                               (v0; a 0..1 ratio despite "perc")
    kvswap_tier_used_bytes{tier}               lmcache:local_cache_usage (bytes)
    kvswap_tier_used_blocks / _capacity_blocks / _capacity_bytes {tier}
    kvswap_tier_watermark_ratio{tier,watermark}
    kvswap_pinned_pool_usage_ratio             (none; lmcache:pinned_memory_objs_count counts)
    kvswap_evictions_total{reason}             lmcache:local_cpu_evict_count
    kvswap_protected_block_saves_total         (none: no one protects sink blocks)
    kvswap_sync_stalls_total                   (none)
    kvswap_preemptions_total                   vllm:num_preemptions_total
    kvswap_prefix_hit_tokens_total{tier}       vllm:prefix_cache_hits_total (tokens),
                                               lmcache:num_hit_tokens
    kvswap_recomputed_tokens_total             (none)
    kvswap_prefetch_hits_total / _misses_total
    kvswap_failed_transfers_total, kvswap_lost_blocks_total
    kvswap_generation_tokens_total             vllm:generation_tokens_total
    kvswap_requests_finished_total             vllm:request_success_total
    kvswap_num_requests_running / _waiting     vllm:num_requests_running / _waiting
    kvswap_num_requests_preempted              vllm:num_requests_swapped (v0)
    kvswap_block_size_bytes                    (vllm:cache_config_info block_size, in tokens)
    kvswap_prefix_hit_tokens_total{tier="remote"}  lmcache:num_hit_tokens (remote backend)
    kvswap_remote_lookups_total                lmcache:num_lookup_requests (one round trip each)
    kvswap_remote_lookup_blocks_total{result}  hit | miss: the remote hit rate is hit / (hit + miss)
    kvswap_remote_misses_total{kind}           lookup (found nothing) | fetch (found, then failed)
    kvswap_remote_writes_total{result}         written | failed (or skipped by the store) | skipped
                                               (never sent: store down, CPU copy gone first)
    kvswap_remote_known_blocks                 (none)
    kvswap_remote_store_events_total{event}    the data plane's counters: corrupt, outages,
                                               reconnects (a flapping store: both climb),
                                               skipped_writes, already_present

The swapper's own counters (evictions, protected saves, prefetch, prefix hits)
are not in `StepSample`; they are read live from the `KVMetrics` registry when
one is given, and every counter is brought up to the final summary's figure
in `on_finish`, so a scrape after the run agrees with `--json`.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from kvswap.base.tier import BUILT_IN_TIERS
from kvswap.base.transfer import BUILT_IN_DIRECTIONS
from kvswap.control.metrics import KVMetrics
from kvswap.errors import KvSwapError
from kvswap.obs.jsonvalues import int_map, integer_or
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.rates import TrailingRate
from kvswap.obs.watermarks import Watermarks

#: vLLM's TTFT buckets, with finer ones below 1 ms for small models.
TTFT_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's per-token latency buckets, with finer ones below 10 ms.
TPOT_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
)  # fmt: skip
DIRECTIONS = tuple(d.value for d in BUILT_IN_DIRECTIONS)
TIERS = tuple(t.value for t in BUILT_IN_TIERS)
#: The data plane's remote counters (the summary's `remote` keys) -> `event` label.
REMOTE_STORE_EVENTS = {
    "corrupt": "corrupt",
    "outages": "outage",
    "reconnects": "reconnect",
    "skipped_writes": "skipped_write",
    "already_present": "already_present",
}


class PrometheusExporter(StepObserver):
    def __init__(
        self,
        *,
        block_bytes: int,
        block_tokens: int,
        watermarks: Watermarks,
        kv_metrics: KVMetrics | None = None,
        throughput_window_s: float = 1.0,
        remote_counters: Callable[[], Mapping[str, int]] | None = None,
    ):
        """`remote_counters`: the data plane's remote counters, read at every step
        (the summary's `remote` object brings them up to date at the end anyway)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.remote_counters = remote_counters
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.kv_metrics = kv_metrics
        self._rate = TrailingRate(throughput_window_s)
        self._seen: dict[tuple[int, str], float] = {}  # counter totals already exported
        self._server: WSGIServer | None = None
        self.port: int | None = None
        self.bound_address: str | None = None  # the numeric address serve() bound
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        d, t = ("direction",), ("tier",)
        self.transfer_bytes = counter("kvswap_transfer_bytes", "KV bytes moved per direction", d)
        self.transfer_seconds = counter(
            "kvswap_transfer_seconds", "Seconds transfers ran per direction", d
        )
        self.transfers = counter("kvswap_transfers", "Transfer chunks finished per direction", d)
        self.link_throughput = gauge(
            "kvswap_link_throughput_bytes_per_second",
            f"Bytes per second moved over the last {throughput_window_s:g} s of the run",
            d,
        )
        self.swap_wait = counter("kvswap_swap_wait_seconds", "Step time spent waiting on swap-in")
        self.step_seconds = counter("kvswap_step_seconds", "Time spent in steps")
        self.steps = counter("kvswap_steps", "Steps run")
        self.swap_wait_ratio = gauge(
            "kvswap_swap_wait_ratio", "Swap-wait share of step time since the start"
        )
        self.ttft = Histogram(
            "kvswap_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS_S,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "kvswap_time_per_output_token_seconds",
            "Latency of each output token after a request's first (inter-token latency)",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.used_blocks = gauge("kvswap_tier_used_blocks", "Blocks in use per tier", t)
        self.capacity_blocks = gauge("kvswap_tier_capacity_blocks", "Block slots per tier", t)
        self.used_bytes = gauge("kvswap_tier_used_bytes", "Bytes of KV held per tier", t)
        self.capacity_bytes = gauge("kvswap_tier_capacity_bytes", "KV capacity per tier", t)
        self.usage = gauge("kvswap_tier_usage_ratio", "Used / capacity per tier (0..1)", t)
        self.watermark = gauge(
            "kvswap_tier_watermark_ratio", "Occupancy watermarks (0..1)", ("tier", "watermark")
        )
        self.pinned_usage = gauge(
            "kvswap_pinned_pool_usage_ratio", "Pinned CPU pool slots in use (0..1)"
        )
        self.evictions = counter("kvswap_evictions", "Blocks evicted, by reason", ("reason",))
        self.protected_saves = counter(
            "kvswap_protected_block_saves", "Evictions refused because the block is protected"
        )
        self.sync_stalls = counter("kvswap_sync_stalls", "Synchronous swap-outs on the step path")
        self.preemptions = counter("kvswap_preemptions", "Sequences preempted")
        self.prefix_hits = counter(
            "kvswap_prefix_hit_tokens", "Prompt tokens whose KV was found, by tier", t
        )
        self.recomputed = counter("kvswap_recomputed_tokens", "Tokens computed again")
        self.prefetch_hits = counter("kvswap_prefetch_hits", "Prefetched blocks used in time")
        self.prefetch_misses = counter("kvswap_prefetch_misses", "Blocks fetched on demand")
        self.failed_transfers = counter("kvswap_failed_transfers", "Transfers that failed")
        self.lost_blocks = counter("kvswap_lost_blocks", "Block copies lost to failed transfers")
        self.generation_tokens = counter("kvswap_generation_tokens", "Tokens generated")
        self.requests_finished = counter("kvswap_requests_finished", "Requests finished")
        self.running = gauge("kvswap_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("kvswap_num_requests_waiting", "Requests not yet admitted")
        self.preempted = gauge("kvswap_num_requests_preempted", "Requests paused by preemption")
        self.remote_lookups = counter(
            "kvswap_remote_lookups", "Remote store lookups (one pipelined round trip each)"
        )
        self.remote_lookup_blocks = counter(
            "kvswap_remote_lookup_blocks", "Blocks looked up in the remote store", ("result",)
        )
        self.remote_misses = counter(
            "kvswap_remote_misses",
            "Remote misses: lookups that found nothing, fetches that failed",
            ("kind",),
        )
        self.remote_writes = counter(
            "kvswap_remote_writes", "Blocks due for the remote store, by outcome", ("result",)
        )
        self.remote_known = gauge(
            "kvswap_remote_known_blocks", "Blocks this process knows the remote store holds"
        )
        self.remote_events = counter(
            "kvswap_remote_store_events", "The remote data plane's own counters", ("event",)
        )
        gauge("kvswap_block_size_bytes", "Bytes of one KV block").set(block_bytes)
        # Known label values exist from the first scrape (at 0), as Prometheus advises.
        for direction in DIRECTIONS:
            for family in (self.transfer_bytes, self.transfer_seconds, self.transfers):
                family.labels(direction)
            self.link_throughput.labels(direction).set(0.0)
        for tier in TIERS:
            self.prefix_hits.labels(tier)
        for family, labels in (
            (self.remote_lookup_blocks, ("hit", "miss")),
            (self.remote_misses, ("lookup", "fetch")),
            (self.remote_writes, ("written", "failed", "skipped")),
            (self.remote_events, tuple(REMOTE_STORE_EVENTS.values())),
        ):
            for label in labels:
                family.labels(label)
        for tier in ("gpu", "cpu"):
            levels = watermarks.for_tier(tier)
            assert levels is not None
            self.watermark.labels(tier, "high").set(levels[0])
            self.watermark.labels(tier, "low").set(levels[1])

    # -- serving ---------------------------------------------------------------------------

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve /metrics on host:port (0 = any free port); returns the bound port."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            reason = error.strerror or str(error)
            if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
                # The host, not the port, is what the user got wrong: name that flag.
                raise KvSwapError(
                    f"--metrics-host {host}: not an address of this machine ({reason}); "
                    "use 127.0.0.1 (the default), ::1 or one of this machine's addresses"
                ) from None
            raise KvSwapError(
                f"--metrics-port {port}: cannot listen on {host}:{port} ({reason}); "
                "choose a free port (1024-65535) or 0 for any"
            ) from None
        self._server = server
        self.bound_address = str(server.server_address[0])
        self.port = int(server.server_address[1])
        return self.port

    @property
    def on_loopback(self) -> bool:
        """Whether /metrics is reachable from this machine only (False before serve())."""
        return self.bound_address is not None and is_loopback_address(self.bound_address)

    def close(self) -> None:
        self.bound_address = None
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def exposition(self) -> str:
        """The text a scrape would return now."""
        return generate_latest(self.registry).decode()

    # -- observer --------------------------------------------------------------------------

    def _total(self, counter: Counter, value: float, *labels: str) -> None:
        """Advance a counter to the cumulative `value` (counters never go down)."""
        key = (id(counter), "/".join(labels))
        delta = value - self._seen.get(key, 0.0)
        if delta > 0:
            (counter.labels(*labels) if labels else counter).inc(delta)
            self._seen[key] = value

    def set_queue_sizes(self, num_running: int, num_waiting: int, num_preempted: int) -> None:
        """The request gauges (each step sets them; a server also when a request ends)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.preempted.set(num_preempted)

    def on_step(self, sample: StepSample) -> None:
        for direction in dict.fromkeys([*DIRECTIONS, *sample.bytes_by_direction]):
            self._total(self.transfer_bytes, sample.bytes_by_direction.get(direction, 0), direction)
            seconds = sample.seconds_by_direction.get(direction, 0.0)
            self._total(self.transfer_seconds, seconds, direction)
        self._rate.add(sample.t_s, sample.bytes_by_direction)
        for direction, per_s in self._rate.per_s().items():
            self.link_throughput.labels(direction).set(per_s)
        self._total(self.swap_wait, sample.swap_wait_total_s)
        self._total(self.step_seconds, sample.step_total_s)
        self.steps.inc()
        if sample.step_total_s > 0:
            self.swap_wait_ratio.set(sample.swap_wait_total_s / sample.step_total_s)
        for value_s in sample.ttfts_s:
            self.ttft.observe(value_s)
        for value_s in sample.token_latencies_s:
            self.tpot.observe(value_s)
        self._tiers(sample.used_blocks_by_tier, sample.capacity_blocks_by_tier)
        self._total(self.sync_stalls, sample.sync_stalls)
        self._total(self.preemptions, sample.preemptions)
        self._total(self.generation_tokens, sample.tokens_generated)
        self._total(self.recomputed, sample.recomputed_tokens)
        self._total(self.requests_finished, sample.requests_finished)
        self.set_queue_sizes(sample.num_running, sample.num_waiting, sample.num_preempted)
        self.remote_known.set(sample.remote_known_blocks)
        if self.kv_metrics is not None:
            self._swapper_counters(self.kv_metrics)
        if self.remote_counters is not None:
            self._remote_events(self.remote_counters())

    def _tiers(self, used: Mapping[str, int], capacity: Mapping[str, int]) -> None:
        for tier in TIERS:
            used_blocks, slots = used.get(tier, 0), capacity.get(tier, 0)
            self.used_blocks.labels(tier).set(used_blocks)
            self.capacity_blocks.labels(tier).set(slots)
            self.used_bytes.labels(tier).set(used_blocks * self.block_bytes)
            self.capacity_bytes.labels(tier).set(slots * self.block_bytes)
            self.usage.labels(tier).set(used_blocks / slots if slots else 0.0)
        cpu_slots = capacity.get("cpu", 0)
        self.pinned_usage.set(used.get("cpu", 0) / cpu_slots if cpu_slots else 0.0)

    def _swapper_counters(self, metrics: KVMetrics) -> None:
        for direction in metrics.directions:
            count = metrics.transfers_by_direction[direction]
            self._total(self.transfers, count, direction.value)
        for reason, count in metrics.evictions_by_reason.items():
            self._total(self.evictions, count, reason)
        self._total(self.protected_saves, metrics.protected_block_saves)
        self._total(self.prefetch_hits, metrics.prefetch_hits)
        self._total(self.prefetch_misses, metrics.prefetch_misses)
        self._total(self.failed_transfers, metrics.failed_transfers)
        self._total(self.lost_blocks, metrics.lost_blocks)
        for tier in metrics.tiers:
            hits = metrics.prefix_hit_blocks_by_tier[tier] * self.block_tokens
            self._total(self.prefix_hits, hits, tier.value)
        self._remote(
            {
                "lookups": metrics.remote_lookups,
                "found_blocks": metrics.remote_found_blocks,
                "lookup_blocks": metrics.remote_lookup_blocks,
                "lookup_misses": metrics.remote_lookup_misses,
                "fetch_failures": metrics.remote_fetch_failures,
                "writes": metrics.remote_writes,
                "write_failures": metrics.remote_write_failures,
                "writes_skipped": metrics.remote_writes_skipped,
            }
        )

    def _remote(self, figures: Mapping[str, int]) -> None:
        """The remote tier's counters from the summary's `remote` keys (or the registry's)."""
        found, asked = figures.get("found_blocks", 0), figures.get("lookup_blocks", 0)
        self._total(self.remote_lookups, figures.get("lookups", 0))
        self._total(self.remote_lookup_blocks, found, "hit")
        self._total(self.remote_lookup_blocks, max(0, asked - found), "miss")
        self._total(self.remote_misses, figures.get("lookup_misses", 0), "lookup")
        self._total(self.remote_misses, figures.get("fetch_failures", 0), "fetch")
        self._total(self.remote_writes, figures.get("writes", 0), "written")
        self._total(self.remote_writes, figures.get("write_failures", 0), "failed")
        self._total(self.remote_writes, figures.get("writes_skipped", 0), "skipped")

    def _remote_events(self, counters: Mapping[str, int]) -> None:
        for key, event in REMOTE_STORE_EVENTS.items():
            self._total(self.remote_events, counters.get(key, 0), event)

    def on_finish(self, summary: dict[str, object]) -> None:
        """Bring every counter to the summary's figure (transfers drained after the last
        step, counters with no per-step source) and zero the live rates."""
        if self.kv_metrics is not None:
            self._swapper_counters(self.kv_metrics)
        keyed = [d.value for d in self.kv_metrics.directions] if self.kv_metrics else []
        for direction in dict.fromkeys([*DIRECTIONS, *keyed]):
            self._total(self.transfer_bytes, integer_or(summary, f"bytes_{direction}"), direction)
            self.link_throughput.labels(direction).set(0.0)
        for reason, count in int_map(summary, "evictions_by_reason").items():
            self._total(self.evictions, count, reason)
        for tier, tokens in int_map(summary, "prefix_hit_tokens").items():
            self._total(self.prefix_hits, tokens, tier)
        plain = (
            (self.protected_saves, "protected_block_saves"),
            (self.sync_stalls, "sync_stalls"),
            (self.preemptions, "preemptions"),
            (self.recomputed, "recomputed_tokens"),
            (self.prefetch_hits, "prefetch_hits"),
            (self.prefetch_misses, "prefetch_misses"),
            (self.failed_transfers, "failed_transfers"),
            (self.lost_blocks, "lost_blocks"),
            (self.generation_tokens, "tokens_generated"),
        )
        for counter, key in plain:
            self._total(counter, integer_or(summary, key))
        remote = int_map(summary, "remote")  # {} from a summary without a remote object
        self._remote(remote)
        self._remote_events(remote)
        self.running.set(0)


def is_loopback_address(address: str) -> bool:
    """Whether a numeric bound address (IPv4, IPv6, IPv4-mapped IPv6) is loopback-only.

    The address the socket bound is judged, not the name the user typed, so
    `localhost` and `127.0.0.2` pass and `0.0.0.0`, `::` or a LAN address do not.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope id
    except ValueError:
        return False  # not numeric: cannot prove it is loopback
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback
