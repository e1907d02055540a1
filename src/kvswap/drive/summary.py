"""The run summary: the keys of `kvswap run --json` (and `kvswap simulate --json`).

Torch-free: built from the scheduler's per-request records and the metrics
registry, so the engine and the simulator report the same quantities the
same way.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvswap.control.scheduler import Scheduler
from kvswap.control.transfer import Direction, Tier


def percentiles_ms(values_s: Sequence[float]) -> dict[str, float]:
    """{p50, p95, p99} in milliseconds (nearest-rank); zeros when there is no sample."""
    if not values_s:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values_s)

    def rank(fraction: float) -> float:
        index = max(0, math.ceil(fraction * len(ordered)) - 1)
        return round(ordered[index] * 1e3, 3)

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99)}


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


def build_summary(
    scheduler: Scheduler, duration_s: float, steps: StepTotals, extra: dict[str, object]
) -> dict[str, object]:
    """One flat JSON object; `extra` adds driver-specific keys (device, model, ...)."""
    metrics = scheduler.swapper.metrics
    store = scheduler.store
    runs = [scheduler.runs[seq_id] for seq_id in sorted(scheduler.runs)]
    completed = [r for r in runs if r.rejected_reason is None and r.finish_s is not None]
    ttft_s = [r.first_token_s - r.arrival_s for r in completed if r.first_token_s is not None]
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
    tokens = sum(len(r.output_ids) for r in completed)
    cpu = store.tiers[Tier.CPU]
    block_tokens = store.block_tokens
    summary: dict[str, object] = {
        "requests_completed": len(completed),
        "requests_rejected": sum(r.rejected_reason is not None for r in runs),
        "rejections": [
            {"request_id": r.seq_id, "reason": r.rejected_reason}
            for r in runs
            if r.rejected_reason is not None
        ],
        "tokens_generated": tokens,
        "duration_s": round(duration_s, 6),
        "throughput_tok_s": round(tokens / duration_s, 3) if duration_s > 0 else 0.0,
        "ttft_ms": percentiles_ms(ttft_s),
        "tpot_ms": percentiles_ms(tpot_s),
        "itl_ms": percentiles_ms(itl_s),
        "num_steps": steps.num_steps,
        "swap_wait_s": round(steps.swap_wait_s, 6),
        "swap_wait_share": round(steps.swap_wait_s / steps.step_s, 6) if steps.step_s else 0.0,
        "bytes_gpu_to_cpu": metrics.bytes_by_direction[Direction.GPU_TO_CPU],
        "bytes_cpu_to_gpu": metrics.bytes_by_direction[Direction.CPU_TO_GPU],
        "bytes_cpu_to_nvme": metrics.bytes_by_direction[Direction.CPU_TO_NVME],
        "bytes_nvme_to_cpu": metrics.bytes_by_direction[Direction.NVME_TO_CPU],
        "gpu_to_cpu_gbps": round(metrics.gbps(Direction.GPU_TO_CPU), 3),
        "cpu_to_gpu_gbps": round(metrics.gbps(Direction.CPU_TO_GPU), 3),
        "pinned_pool_utilization_peak": (
            round(cpu.peak_used_slots / cpu.num_slots, 4) if cpu.num_slots else 0.0
        ),
        "sync_stalls": metrics.sync_stalls,
        "preemptions": scheduler.num_preemptions,
        "prefix_hit_tokens": {
            tier.value: metrics.prefix_hit_blocks_by_tier[tier] * block_tokens for tier in Tier
        },
        "recomputed_tokens": sum(r.recomputed_tokens for r in runs),
        "protected_block_saves": metrics.protected_block_saves,
        "prefetch_hits": metrics.prefetch_hits,
        "prefetch_misses": metrics.prefetch_misses,
        "evictions_by_reason": dict(sorted(metrics.evictions_by_reason.items())),
        "failed_transfers": metrics.failed_transfers,
        "lost_blocks": metrics.lost_blocks,
        "peak_blocks_by_tier": {t.value: store.tiers[t].peak_used_slots for t in Tier},
        "capacity_blocks_by_tier": {t.value: store.tiers[t].num_slots for t in Tier},
        "outputs_digest": outputs_digest([(r.seq_id, r.output_ids) for r in completed]),
    }
    summary.update(extra)
    return summary
