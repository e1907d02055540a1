"""What a driver (engine or simulator) reports after every step, and who listens.

Torch-free. The driver builds one `StepSample` per step with `sample_step`
and hands it to each `StepObserver` (a time-series recorder, the Prometheus
exporter, the live terminal view). Counters in a sample are cumulative since
the start of the run; latencies are the ones produced by this step.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence
from dataclasses import dataclass

from kvswap.base.tier import Tier
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import StepPlan


@dataclass(frozen=True)
class StepSample:
    t_s: float  # seconds since the run started (wall clock, or virtual in the simulator)
    step: int
    step_s: float  # this step's duration
    swap_wait_s: float  # of which waiting for swap-in
    num_running: int
    num_preempted: int
    num_waiting: int
    requests_finished: int
    tokens_generated: int  # cumulative
    recomputed_tokens: int  # cumulative
    used_blocks_by_tier: dict[str, int]
    capacity_blocks_by_tier: dict[str, int]
    bytes_by_direction: dict[str, int]  # cumulative, keys Direction values
    seconds_by_direction: dict[str, float]  # cumulative transfer time per direction
    swap_wait_total_s: float  # cumulative
    step_total_s: float  # cumulative
    sync_stalls: int  # cumulative
    preemptions: int  # cumulative
    token_latencies_s: tuple[float, ...]  # inter-token latencies of tokens emitted this step
    ttfts_s: tuple[float, ...]  # time to first token of requests whose first token came now
    # Tokens computed beyond one per sampling sequence: prompt chunks and recomputation
    # sharing the step with the decodes (whose latency they stretch). A default keeps
    # samples built by hand valid; `sample_step` always fills it.
    num_prefill_tokens: int = 0
    # The shared keyed tiers (cumulative; all 0 and `remote_enabled` False without one:
    # the NVMe slab is not one, its bytes are the link's nvme directions).
    remote_enabled: bool = False
    remote_hit_tokens: int = 0  # prompt tokens found in the remote store
    remote_misses: int = 0  # lookups that found nothing + fetches that failed
    remote_writes: int = 0  # blocks written
    remote_known_blocks: int = 0  # blocks this process knows the store holds (now)


class StepObserver(ABC):  # noqa: B024 - both hooks are optional
    """Receives every step's sample, then the final summary. Called from the driver's
    thread; implementations must be quick (they run between steps)."""

    def on_step(self, sample: StepSample) -> None:  # noqa: B027
        """One step finished."""

    def on_finish(self, summary: dict[str, object]) -> None:  # noqa: B027
        """The run finished; `summary` is the --json object."""


def sample_step(
    scheduler: Scheduler,
    plan: StepPlan,
    finished_now: Sequence[int],
    *,
    t_s: float,
    step_s: float,
    step_total_s: float,
    swap_wait_total_s: float,
) -> StepSample:
    """Build the sample for the step `plan` that just completed at `t_s`."""
    metrics = scheduler.swapper.metrics
    store = scheduler.swapper.store  # the swapper owns it; the scheduler need not re-export it
    occupancy = scheduler.swapper.occupancy()
    latencies: list[float] = []
    ttfts: list[float] = []
    for item in plan.seqs:
        if not item.samples:
            continue
        run = scheduler.runs[item.seq_id]
        times = run.token_times_s
        if len(times) >= 2:
            latencies.append(times[-1] - times[-2])
        elif len(times) == 1 and run.first_token_s is not None:
            ttfts.append(run.first_token_s - run.arrival_s)
    return StepSample(
        t_s=t_s,
        step=plan.step,
        step_s=step_s,
        swap_wait_s=plan.swap_wait_s,
        num_running=len(scheduler.running),
        num_preempted=len(scheduler.preempted),
        num_waiting=len(scheduler.waiting),
        requests_finished=len(scheduler.finished),
        tokens_generated=scheduler.tokens_generated,
        recomputed_tokens=scheduler.recomputed_tokens,
        used_blocks_by_tier={t.value: o.num_used_blocks for t, o in occupancy.items()},
        capacity_blocks_by_tier={t.value: o.num_blocks for t, o in occupancy.items()},
        bytes_by_direction={d.value: metrics.bytes_by_direction[d] for d in metrics.directions},
        seconds_by_direction={
            d.value: metrics.seconds_by_direction.get(d, 0.0) for d in metrics.directions
        },
        swap_wait_total_s=swap_wait_total_s,
        step_total_s=step_total_s,
        sync_stalls=metrics.sync_stalls,
        preemptions=scheduler.num_preemptions,
        token_latencies_s=tuple(latencies),
        ttfts_s=tuple(ttfts),
        num_prefill_tokens=sum(len(item.token_ids) - int(item.samples) for item in plan.seqs),
        remote_enabled=scheduler.swapper.has_shared_tier,
        remote_hit_tokens=metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] * store.block_tokens,
        remote_misses=metrics.remote_lookup_misses + metrics.remote_fetch_failures,
        remote_writes=metrics.remote_writes,
        remote_known_blocks=store.num_remote_copies,
    )
