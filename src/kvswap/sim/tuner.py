"""`kvswap tune`: the seed article's tuning order, one knob at a time, in the simulator.

    1. block size        fixed first: every other knob is counted in blocks
    2. high watermark    0.95 down in 0.05 steps (above the low watermark)
    3. swap-out chunk    transfers of 4..64 MiB, in blocks
    4. prefetch streams  1, 2, 4

Each candidate is one simulation of the same workload with only that knob
changed from the best configuration so far. The choice, per knob:

- keep the candidates whose throughput is within 2% of the sweep's best;
- among them, the lowest P99 token latency wins; P99s within 2% of the
  lowest tie, and a tie goes to the lower host<->device link utilisation
  (within 1 point), then to the knob's safer end: the lower watermark (more
  headroom before a sequence's growth forces a synchronous eviction), the chunk
  nearest 16 MiB (the seed article's 8-32 MB), the fewer streams. When every
  candidate ties, the workload does not separate them, and the reason says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.config import KvSwapConfig
from kvswap.errors import ConfigError
from kvswap.progress import TrialProgress
from kvswap.sim.hardware import HardwareProfile
from kvswap.sim.setup import resolve_setup
from kvswap.sim.simulator import SimOptions, Simulator
from kvswap.units import MIB
from kvswap.workload.request import Workload

WATERMARK_CANDIDATES = (0.95, 0.90, 0.85, 0.80, 0.75, 0.70)
CHUNK_CANDIDATES_BYTES = (4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB)
STREAM_CANDIDATES = (1, 2, 4)
THROUGHPUT_TOLERANCE = 0.02
P99_TOLERANCE = 0.02
LINK_TOLERANCE = 0.01


@dataclass(frozen=True)
class Trial:
    knob: str
    value: float
    throughput_tok_s: float
    p50_itl_ms: float
    p99_itl_ms: float
    swap_wait_share: float
    link_utilization: float  # the busier host<->device direction, share of the run
    sync_stalls: int

    def line(self) -> str:
        what = "the given config" if self.knob == "baseline" else f"{self.knob} = {self.value:g}"
        return (
            f"{what}: {self.throughput_tok_s:.1f} tok/s, P99 "
            f"{self.p99_itl_ms:.1f} ms, swap-wait {100 * self.swap_wait_share:.1f} %, link "
            f"{100 * self.link_utilization:.1f} %, {self.sync_stalls} sync stalls"
        )


@dataclass(frozen=True)
class TuneStep:
    knob: str
    trials: tuple[Trial, ...]
    chosen: float
    reason: str


@dataclass(frozen=True)
class TuneResult:
    baseline: Trial
    steps: tuple[TuneStep, ...]
    config: KvSwapConfig


def with_swap(config: KvSwapConfig, **values: object) -> KvSwapConfig:
    """`config` with [swap] fields replaced, validated again (ConfigError if invalid)."""
    data = config.model_dump()
    data["swap"] = {**data["swap"], **values}
    try:
        return KvSwapConfig.model_validate(data)
    except ValueError as error:
        raise ConfigError(f"{values}: {error}") from None


#: The simulator's host<->device link names (one shared engine, or one per direction);
#: the NVMe drive and the remote links are not what the tuner's knobs load.
_HOST_DEVICE_LINKS = frozenset({"pcie", "gpu_to_cpu", "cpu_to_gpu"})


def measure(
    config: KvSwapConfig, hardware: HardwareProfile, workload: Workload, options: SimOptions,
    knob: str, value: float,
) -> Trial:  # fmt: skip
    summary = Simulator(config, hardware, options=options).run(workload).to_json()
    itl, links = summary["itl_ms"], summary["link_utilization"]
    assert isinstance(itl, dict) and isinstance(links, dict)
    pcie = [float(share) for name, share in links.items() if name in _HOST_DEVICE_LINKS]
    return Trial(
        knob=knob,
        value=value,
        throughput_tok_s=_number(summary, "throughput_tok_s"),
        p50_itl_ms=float(itl["p50"]),
        p99_itl_ms=float(itl["p99"]),
        swap_wait_share=_number(summary, "swap_wait_share"),
        link_utilization=max(pcie, default=0.0),
        sync_stalls=int(_number(summary, "sync_stalls")),
    )


def _number(summary: dict[str, object], key: str) -> float:
    value = summary[key]
    assert isinstance(value, int | float)
    return float(value)


def choose(trials: Sequence[Trial], preference: Callable[[float], float]) -> tuple[Trial, str]:
    """The rule in the module docstring; `preference` ranks values (lower = preferred)."""
    best_tps = max(t.throughput_tok_s for t in trials)
    fast = [t for t in trials if t.throughput_tok_s >= (1 - THROUGHPUT_TOLERANCE) * best_tps]
    low_p99 = min(t.p99_itl_ms for t in fast)
    tied = [t for t in fast if t.p99_itl_ms <= (1 + P99_TOLERANCE) * low_p99]
    low_link = min(t.link_utilization for t in tied)
    tied = [t for t in tied if t.link_utilization <= low_link + LINK_TOLERANCE]
    pick = min(tied, key=lambda t: preference(t.value))
    reason = (
        f"{pick.knob} = {pick.value:g}: P99 {pick.p99_itl_ms:.1f} ms (lowest within "
        f"{100 * THROUGHPUT_TOLERANCE:g}% of the best throughput, {best_tps:.1f} tok/s)"
    )
    if len(tied) == len(trials) > 1:
        reason += (
            f"; all {len(trials)} candidates tied (this workload does not separate them), "
            "kept the safer end"
        )
    elif len(tied) > 1:
        reason += f"; {len(tied)} candidates tied, kept the safer end"
    slow = [t for t in trials if t not in fast]
    if slow:
        reason += "; too slow: " + ", ".join(f"{t.value:g}" for t in slow)
    return pick, reason


def tune(
    config: KvSwapConfig,
    hardware: HardwareProfile,
    workload: Workload,
    *,
    options: SimOptions | None = None,
    progress: TrialProgress | None = None,
) -> TuneResult:
    options = options if options is not None else SimOptions()
    setup = resolve_setup(config, hardware)  # fails before any simulation
    block_bytes = setup.block_bytes
    low = config.swap.swap_out_low_watermark
    watermarks = [w for w in WATERMARK_CANDIDATES if w > low]
    max_chunk = setup.capacities.num_gpu_blocks
    chunks = sorted(
        {min(max_chunk, max(1, size // block_bytes)) for size in CHUNK_CANDIDATES_BYTES}
    )
    planned = 1 + len(watermarks) + len(chunks) + len(STREAM_CANDIDATES)
    done = 0

    def run(current: KvSwapConfig, knob: str, value: float) -> Trial:
        nonlocal done
        trial = measure(current, hardware, workload, options, knob, value)
        done += 1
        if progress is not None:
            progress(done, planned, trial.line())
        return trial

    baseline = run(config, "baseline", 0)
    steps: list[TuneStep] = []
    current = config
    sweeps: list[tuple[str, Sequence[float], Callable[[float], float]]] = [
        ("swap_out_high_watermark", watermarks, lambda v: v),
        ("swap_out_chunk_blocks", chunks, lambda v: abs(v * block_bytes - 16 * MIB)),
        ("prefetch_stream_count", STREAM_CANDIDATES, lambda v: v),
    ]
    for knob, values, preference in sweeps:
        trials = []
        for value in values:
            typed = value if knob == "swap_out_high_watermark" else int(value)
            trials.append(run(with_swap(current, **{knob: typed}), knob, value))
        pick, reason = choose(trials, preference)
        chosen = pick.value if knob == "swap_out_high_watermark" else int(pick.value)
        current = with_swap(current, **{knob: chosen})
        steps.append(TuneStep(knob, tuple(trials), pick.value, reason))
    return TuneResult(baseline, tuple(steps), current)
