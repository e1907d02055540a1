"""Test helpers for the observability tests: synthetic runs and a tiny real engine run."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.timeseries import DIRECTIONS, TIERS, TimeSeries, TimeSeriesRecorder
from kvswap.percentiles import percentiles_ms
from kvswap.workload.synthetic import SyntheticSpec

# A tiny model on a GPU pool too small for the workload: it swaps, preempts and fills
# the 8-slot pinned pool (see tests/integration/test_engine_outputs.py for the numbers).
TINY_SPEC = SyntheticSpec(
    num_sessions=6,
    turns_per_session=2,
    prompt_tokens=40,
    output_tokens=16,
    user_tokens_per_turn=8,
    system_prompt_tokens=16,
    vocab_size=256,
    seed=3,
)
TINY_SETTINGS: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "min_residency_steps": 4,
    "swap_out_chunk_blocks": 2,
    "swap_in_chunk_blocks": 2,
    "max_num_seqs": 4,
    "device": "cpu",
    "gpu_kv_capacity_blocks": 12,
    "cpu_kv_capacity_blocks": 8,
}
TINY_CLI_ARGS: tuple[str, ...] = (
    "--model", "tiny", "--num-sessions", "6", "--prompt-tokens", "40", "--output-tokens", "16",
    "--user-tokens", "8", "--system-prompt-tokens", "16", "--seed", "3", "--block-tokens", "8",
    "--evict-protected-blocks", "1", "--min-residency-steps", "4", "--swap-out-chunk-blocks", "2",
    "--swap-in-chunk-blocks", "2", "--max-num-seqs", "4", "--device", "cpu",
    "--gpu-kv-capacity-blocks", "12", "--cpu-kv-capacity-blocks", "8",
)  # fmt: skip


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a busy 2-core machine: one intra-op thread avoids OpenMP
    oversubscription (steps 100x slower when another process holds a core)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Step:
    """What one synthetic step does; counters are per step (the builder accumulates)."""

    step_s: float = 0.01
    swap_wait_s: float = 0.0
    used: dict[str, int] = field(default_factory=lambda: {"gpu": 50, "cpu": 10, "nvme": 0})
    moved: dict[str, int] = field(default_factory=dict)  # bytes per direction this step
    latencies_s: tuple[float, ...] = (0.01, 0.01, 0.01, 0.01)
    ttfts_s: tuple[float, ...] = ()


CAPACITY = {"gpu": 100, "cpu": 100, "nvme": 0}


def samples(steps: Sequence[Step], capacity: dict[str, int] | None = None) -> list[StepSample]:
    """Cumulative samples of `steps` run back to back from t = 0."""
    out: list[StepSample] = []
    t_s = wait_s = total_s = 0.0
    moved = dict.fromkeys(DIRECTIONS, 0)
    seconds = dict.fromkeys(DIRECTIONS, 0.0)
    tokens = 0
    for index, step in enumerate(steps):
        t_s += step.step_s
        wait_s += step.swap_wait_s
        total_s += step.step_s
        for direction, num_bytes in step.moved.items():  # a keyed tier's past the first too
            moved[direction] = moved.get(direction, 0) + num_bytes
            seconds[direction] = seconds.get(direction, 0.0) + step.step_s / 2
        tokens += len(step.latencies_s) + len(step.ttfts_s)
        out.append(
            StepSample(
                t_s=t_s, step=index, step_s=step.step_s, swap_wait_s=step.swap_wait_s,
                num_running=4, num_preempted=0, num_waiting=0, requests_finished=index // 10,
                tokens_generated=tokens, recomputed_tokens=0,
                used_blocks_by_tier={t: step.used.get(t, 0) for t in TIERS},
                capacity_blocks_by_tier=dict(capacity or CAPACITY), bytes_by_direction=dict(moved),
                seconds_by_direction=dict(seconds), swap_wait_total_s=wait_s, step_total_s=total_s,
                sync_stalls=0, preemptions=0, token_latencies_s=step.latencies_s,
                ttfts_s=step.ttfts_s,
            )
        )  # fmt: skip
    return out


def record(
    steps: Sequence[Step],
    capacity: dict[str, int] | None = None,
    observers: Sequence[StepObserver] = (),
) -> tuple[dict[str, Any], TimeSeries]:
    """(summary, series) of a synthetic run, the summary holding what the rules read."""
    recorder = TimeSeriesRecorder()
    run = samples(steps, capacity)
    for sample in run:
        recorder.on_step(sample)
        for observer in observers:
            observer.on_step(sample)
    last = run[-1]
    cap = capacity or CAPACITY
    summary: dict[str, Any] = {
        "swap_wait_s": last.swap_wait_total_s,
        "swap_wait_share": last.swap_wait_total_s / last.step_total_s,
        **{f"bytes_{d}": n for d, n in last.bytes_by_direction.items()},
        "capacity_blocks_by_tier": dict(cap),
        "sync_stalls": 0,
        # As a real summary: the percentiles of every token latency the steps emitted.
        "itl_ms": percentiles_ms([s for step in steps for s in step.latencies_s]),
    }
    return summary, recorder.series()
