"""The run summary: one typed record of a run, and the keys of `kvswap run --json`.

Torch-free: built from the scheduler's per-request records and the metrics
registry, so the engine and the simulator report the same quantities the
same way. `RunSummary.to_json()` is the flat `--json` object (and what
observers, reports and the diagnosis read); its key names are a public
format, kept stable.

The remote tier is one nested object, `remote` (`RemoteSummary`): the control
plane's figures, and the data plane's counters, which a backend hands over as
the mapping under the key `remote` of its `summary_extras` (e.g. corrupt,
skipped_writes, outages, already_present; any integer it names is kept).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction
from kvswap.control.metrics import KVMetrics
from kvswap.control.scheduler import Scheduler
from kvswap.percentiles import percentiles_ms

#: The data plane's remote counters every summary carries (0 when none was reported).
REMOTE_DATA_PLANE_KEYS = ("corrupt", "skipped_writes", "outages", "already_present")


def outputs_digest(outputs: Sequence[tuple[int, Sequence[int]]]) -> str:
    """sha256 of every request's generated ids, in request order."""
    digest = hashlib.sha256()
    for request_id, ids in sorted(outputs, key=lambda item: item[0]):
        digest.update(json.dumps([request_id, list(ids)]).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class StepTotals:
    """Time the driver spent in steps, and how much of it waited on swap-in."""

    num_steps: int
    step_s: float
    swap_wait_s: float


@dataclass(frozen=True)
class Rejection:
    """A request refused at admission, or aborted mid-run (its sampling failed)."""

    request_id: int
    reason: str


@dataclass(frozen=True)
class RemoteSummary:
    """The remote tier over a run. Blocks are counted in blocks, hits in tokens;
    `misses` = lookups that found nothing + fetches that failed."""

    enabled: bool
    hit_tokens: int
    lookups: int
    lookup_misses: int
    lookup_blocks: int
    found_blocks: int
    fetch_failures: int
    writes: int
    write_failures: int
    writes_skipped: int
    bytes_to_remote: int
    bytes_from_remote: int
    seconds_to_remote: float
    seconds_from_remote: float
    data_plane: Mapping[str, int] = field(default_factory=dict)

    @property
    def misses(self) -> int:
        return self.lookup_misses + self.fetch_failures

    @property
    def hit_rate(self) -> float:
        """Blocks found of the blocks looked up (0 before any lookup)."""
        return round(self.found_blocks / self.lookup_blocks, 6) if self.lookup_blocks else 0.0

    @classmethod
    def from_metrics(
        cls,
        metrics: KVMetrics,
        *,
        enabled: bool,
        block_tokens: int,
        data_plane: Mapping[str, object] | None = None,
    ) -> RemoteSummary:
        counters = dict.fromkeys(REMOTE_DATA_PLANE_KEYS, 0)
        for key, value in (data_plane or {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                counters[str(key)] = value
        return cls(
            enabled=enabled,
            hit_tokens=metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] * block_tokens,
            lookups=metrics.remote_lookups,
            lookup_misses=metrics.remote_lookup_misses,
            lookup_blocks=metrics.remote_lookup_blocks,
            found_blocks=metrics.remote_found_blocks,
            fetch_failures=metrics.remote_fetch_failures,
            writes=metrics.remote_writes,
            write_failures=metrics.remote_write_failures,
            writes_skipped=metrics.remote_writes_skipped,
            bytes_to_remote=metrics.bytes_by_direction[Direction.CPU_TO_REMOTE],
            bytes_from_remote=metrics.bytes_by_direction[Direction.REMOTE_TO_CPU],
            seconds_to_remote=round(metrics.seconds_by_direction[Direction.CPU_TO_REMOTE], 6),
            seconds_from_remote=round(metrics.seconds_by_direction[Direction.REMOTE_TO_CPU], 6),
            data_plane=counters,
        )

    def to_json(self) -> dict[str, object]:
        """The `remote` object; a data-plane counter named like a control-plane figure
        does not replace it."""
        figures: dict[str, object] = {
            "enabled": self.enabled,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
            "lookups": self.lookups,
            "lookup_blocks": self.lookup_blocks,
            "found_blocks": self.found_blocks,
            "misses": self.misses,
            "lookup_misses": self.lookup_misses,
            "fetch_failures": self.fetch_failures,
            "writes": self.writes,
            "write_failures": self.write_failures,
            "writes_skipped": self.writes_skipped,
            "bytes_to_remote": self.bytes_to_remote,
            "bytes_from_remote": self.bytes_from_remote,
            "seconds_to_remote": self.seconds_to_remote,
            "seconds_from_remote": self.seconds_from_remote,
        }
        for key, count in sorted(self.data_plane.items()):
            figures.setdefault(key, count)
        return figures


@dataclass(frozen=True)
class RunSummary:
    """What a run did. Latency figures are {p50, p95, p99} in ms; byte and block
    counts are exact; `backend` holds the driver's own keys (device, model,
    hardware, simulator figures), merged flat into `to_json()`."""

    requests_completed: int
    rejections: tuple[Rejection, ...]
    tokens_generated: int
    duration_s: float
    ttft_ms: Mapping[str, float]
    # Arrival to admission (the first step that ran it), and its share of the summed
    # time to first token: what waiting in the queue, not computing, cost.
    queue_wait_ms: Mapping[str, float]
    queue_share_of_ttft: float
    tpot_ms: Mapping[str, float]
    itl_ms: Mapping[str, float]
    num_steps: int
    swap_wait_s: float
    swap_wait_share: float
    bytes_by_direction: Mapping[Direction, int]
    gb_per_s_by_direction: Mapping[Direction, float]
    pinned_pool_utilization_peak: float
    sync_stalls: int
    preemptions: int
    prefix_hit_tokens: Mapping[Tier, int]
    recomputed_tokens: int
    protected_block_saves: int
    prefetch_hits: int
    prefetch_misses: int
    evictions_by_reason: Mapping[str, int]
    failed_transfers: int
    lost_blocks: int
    peak_blocks_by_tier: Mapping[Tier, int]
    capacity_blocks_by_tier: Mapping[Tier, int]
    outputs_digest: str
    backend: Mapping[str, object] = field(default_factory=dict)
    remote: RemoteSummary | None = None  # None: a summary built by hand, without one

    @property
    def requests_rejected(self) -> int:
        return len(self.rejections)

    @property
    def throughput_tok_s(self) -> float:
        return round(self.tokens_generated / self.duration_s, 3) if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """The flat `--json` object."""
        out: dict[str, object] = {
            "requests_completed": self.requests_completed,
            "requests_rejected": self.requests_rejected,
            "rejections": [
                {"request_id": r.request_id, "reason": r.reason} for r in self.rejections
            ],
            "tokens_generated": self.tokens_generated,
            "duration_s": self.duration_s,
            "throughput_tok_s": self.throughput_tok_s,
            "ttft_ms": dict(self.ttft_ms),
            "queue_wait_ms": dict(self.queue_wait_ms),
            "queue_share_of_ttft": self.queue_share_of_ttft,
            "tpot_ms": dict(self.tpot_ms),
            "itl_ms": dict(self.itl_ms),
            "num_steps": self.num_steps,
            "swap_wait_s": self.swap_wait_s,
            "swap_wait_share": self.swap_wait_share,
        }
        for direction, num_bytes in self.bytes_by_direction.items():
            out[f"bytes_{direction.value}"] = num_bytes
        for direction in (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU):
            out[f"{direction.value}_gb_per_s"] = self.gb_per_s_by_direction.get(direction, 0.0)
        out.update(
            {
                "pinned_pool_utilization_peak": self.pinned_pool_utilization_peak,
                "sync_stalls": self.sync_stalls,
                "preemptions": self.preemptions,
                "prefix_hit_tokens": {
                    t.value: num_tokens for t, num_tokens in self.prefix_hit_tokens.items()
                },
                "recomputed_tokens": self.recomputed_tokens,
                "protected_block_saves": self.protected_block_saves,
                "prefetch_hits": self.prefetch_hits,
                "prefetch_misses": self.prefetch_misses,
                "evictions_by_reason": dict(sorted(self.evictions_by_reason.items())),
                "failed_transfers": self.failed_transfers,
                "lost_blocks": self.lost_blocks,
                "peak_blocks_by_tier": {t.value: n for t, n in self.peak_blocks_by_tier.items()},
                "capacity_blocks_by_tier": {
                    t.value: n for t, n in self.capacity_blocks_by_tier.items()
                },
                "outputs_digest": self.outputs_digest,
            }
        )
        if self.remote is not None:
            out["remote"] = self.remote.to_json()
        out.update(self.backend)
        return out


def _aborted(abort_reason: str | None) -> str | None:
    return None if abort_reason is None else f"aborted mid-run: {abort_reason}"


def build_summary(
    scheduler: Scheduler,
    duration_s: float,
    steps: StepTotals,
    backend: Mapping[str, object],
) -> RunSummary:
    """The summary of the run `scheduler` just finished."""
    metrics = scheduler.swapper.metrics
    runs = [scheduler.runs[seq_id] for seq_id in sorted(scheduler.runs)]
    completed = [
        r
        for r in runs
        if r.rejected_reason is None and r.abort_reason is None and r.finish_s is not None
    ]
    ttft_s = [r.first_token_s - r.arrival_s for r in completed if r.first_token_s is not None]
    # (queue wait, time to first token) of each request that produced a token
    waits = [
        (r.admitted_s - r.arrival_s, r.first_token_s - r.arrival_s)
        for r in completed
        if r.first_token_s is not None and r.admitted_s is not None
    ]
    queue_s = [queue for queue, _ in waits]
    started_ttft_s = sum(ttft for _, ttft in waits)
    tpot_s = [
        (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
        for r in completed
        if len(r.token_times_s) > 1
    ]
    itl_s = [
        later - earlier
        for r in completed
        for earlier, later in zip(r.token_times_s, r.token_times_s[1:], strict=False)
    ]
    occupancy = scheduler.swapper.occupancy()
    cpu = occupancy[Tier.CPU]
    block_tokens = scheduler.swapper.block_tokens
    extras = dict(backend)
    remote_counters = extras.pop("remote", None)
    remote = RemoteSummary.from_metrics(
        metrics,
        enabled=scheduler.swapper.has_shared_tier,
        block_tokens=block_tokens,
        data_plane=remote_counters if isinstance(remote_counters, Mapping) else None,
    )
    return RunSummary(
        requests_completed=len(completed),
        rejections=tuple(
            Rejection(r.seq_id, reason)
            for r in runs
            if (reason := r.rejected_reason or _aborted(r.abort_reason)) is not None
        ),
        tokens_generated=sum(len(r.output_ids) for r in completed),
        duration_s=round(duration_s, 6),
        ttft_ms=percentiles_ms(ttft_s),
        queue_wait_ms=percentiles_ms(queue_s),
        queue_share_of_ttft=round(sum(queue_s) / started_ttft_s, 4) if started_ttft_s > 0 else 0.0,
        tpot_ms=percentiles_ms(tpot_s),
        itl_ms=percentiles_ms(itl_s),
        num_steps=steps.num_steps,
        swap_wait_s=round(steps.swap_wait_s, 6),
        swap_wait_share=round(steps.swap_wait_s / steps.step_s, 6) if steps.step_s else 0.0,
        bytes_by_direction={d: metrics.bytes_by_direction[d] for d in metrics.directions},
        gb_per_s_by_direction={d: round(metrics.gb_per_s(d), 3) for d in metrics.directions},
        pinned_pool_utilization_peak=(
            round(cpu.peak_used_blocks / cpu.num_blocks, 4) if cpu.num_blocks else 0.0
        ),
        sync_stalls=metrics.sync_stalls,
        preemptions=scheduler.num_preemptions,
        prefix_hit_tokens={
            tier: metrics.prefix_hit_blocks_by_tier[tier] * block_tokens for tier in metrics.tiers
        },
        recomputed_tokens=sum(r.recomputed_tokens for r in runs),
        protected_block_saves=metrics.protected_block_saves,
        prefetch_hits=metrics.prefetch_hits,
        prefetch_misses=metrics.prefetch_misses,
        evictions_by_reason=dict(metrics.evictions_by_reason),
        failed_transfers=metrics.failed_transfers,
        lost_blocks=metrics.lost_blocks,
        # The tiers with slots and the NVMe slab (a shared store's capacity is not the
        # control plane's to know).
        peak_blocks_by_tier={t: o.peak_used_blocks for t, o in occupancy.items()},
        capacity_blocks_by_tier={t: o.num_blocks for t, o in occupancy.items()},
        outputs_digest=outputs_digest([(r.seq_id, r.output_ids) for r in completed]),
        backend=extras,
        remote=remote,
    )
