"""Several simulated engines replaying one workload, optionally sharing a remote store.

    workload --split_workload--> share 0 --> Simulator 0 (own clock, control plane,
                                 share 1 --> Simulator 1   modelled copy engine)
                                 ...              \\        /
                                                SharedRemoteStore (optional)

Each engine is a whole `Simulator`; their loops are interleaved one step at a
time, always stepping the engine whose virtual clock is earliest (ties: the
lowest index). So when an engine looks up or reads the shared store at time t
every other engine has run to t or past it, and every write that ended by t
is visible (`remote_store.py`). Same seed, same run: the order of steps
depends only on the virtual clocks.

`combined()` is the fleet's view: every request of every engine, TTFT
percentiles over all of them, throughput over the longest engine's time.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.base.tier import BUILT_IN_TIERS
from kvswap.base.transfer import Direction
from kvswap.config import KvSwapConfig
from kvswap.drive.summary import RunSummary, outputs_digest
from kvswap.percentiles import percentiles_ms
from kvswap.progress import RequestProgress
from kvswap.sim.hardware import HardwareProfile
from kvswap.sim.keyed_tier import ModelledKeyedTier
from kvswap.sim.remote_store import SharedRemoteStore
from kvswap.sim.routing import EngineShare, Route, split_workload
from kvswap.sim.simulator import SimOptions, Simulator
from kvswap.workload.request import Workload

#: At most this many engines in one simulation (each holds a whole control plane).
MAX_ENGINES = 256

#: Keys of an engine's summary that measure the host, not the simulation.
VOLATILE_KEYS = ("wall_s", "simulated_s_per_wall_s")


@dataclass(frozen=True)
class EngineRun:
    """One engine after the run: its simulator, its workload-wide request ids, its summary."""

    index: int
    simulator: Simulator
    request_ids: tuple[int, ...]
    summary: RunSummary

    @property
    def prefill_tokens_computed(self) -> int:
        return prefill_tokens_computed(self.simulator)

    def to_json(self) -> dict[str, object]:
        return {
            "engine": self.index,
            **self.summary.to_json(),
            "prefill_tokens_computed": self.prefill_tokens_computed,
        }


def prefill_tokens_computed(simulator: Simulator) -> int:
    """Tokens the forward passes computed that were not decode steps: every
    computed token less one per output token that was fed back (all but each
    request's last). Prompt tokens found on a tier are not computed; recomputed
    KV is."""
    fed_back = sum(max(0, len(run.output_ids) - 1) for run in simulator.scheduler.runs.values())
    return simulator.tokens_computed - fed_back


@dataclass(frozen=True)
class MultiRun:
    engines: tuple[EngineRun, ...]
    route: Route
    store: SharedRemoteStore | None

    def combined(self) -> dict[str, object]:
        """Every engine together (the fleet as its users see it)."""
        runs = [
            (engine.request_ids[seq_id], run)
            for engine in self.engines
            for seq_id, run in engine.simulator.scheduler.runs.items()
        ]
        completed = [
            (rid, r) for rid, r in runs if r.rejected_reason is None and r.finish_s is not None
        ]
        ttft_s = [
            r.first_token_s - r.arrival_s for _, r in completed if r.first_token_s is not None
        ]
        tpot_s = [
            (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
            for _, r in completed
            if len(r.token_times_s) > 1
        ]
        summaries = [engine.summary for engine in self.engines]
        # By name: the built-in tiers and the store's directions, then any other keyed
        # tier's (an engine's own slab is reported under the name of the tier it is).
        hits: Counter[str] = Counter(dict.fromkeys((t.value for t in BUILT_IN_TIERS), 0))
        keyed: Counter[str] = Counter(dict.fromkeys(
            (d.value for d in (Direction.CPU_TO_REMOTE, Direction.REMOTE_TO_CPU)), 0
        ))  # fmt: skip
        for summary in summaries:
            hits.update({tier.value: n for tier, n in summary.prefix_hit_tokens.items()})
            keyed.update({d.value: n for d, n in summary.bytes_by_direction.items() if d.keyed})
        duration_s = max((s.duration_s for s in summaries), default=0.0)
        tokens = sum(s.tokens_generated for s in summaries)
        return {
            "requests_completed": sum(s.requests_completed for s in summaries),
            "requests_rejected": sum(s.requests_rejected for s in summaries),
            "tokens_generated": tokens,
            "duration_s": duration_s,
            "throughput_tok_s": round(tokens / duration_s, 3) if duration_s > 0 else 0.0,
            "ttft_ms": percentiles_ms(ttft_s),
            "tpot_ms": percentiles_ms(tpot_s),
            "prefix_hit_tokens": dict(hits),
            "recomputed_tokens": sum(s.recomputed_tokens for s in summaries),
            "prefill_tokens_computed": sum(e.prefill_tokens_computed for e in self.engines),
            "preemptions": sum(s.preemptions for s in summaries),
            "swap_wait_s": round(sum(s.swap_wait_s for s in summaries), 6),
            **{f"bytes_{name}": num_bytes for name, num_bytes in keyed.items()},
            # Over workload-wide ids: equal to one engine's digest when every request ran.
            "outputs_digest": outputs_digest([(rid, r.output_ids) for rid, r in completed]),
        }

    def to_json(self) -> dict[str, object]:
        return {
            "engines": len(self.engines),
            "route": self.route.value,
            "combined": self.combined(),
            "per_engine": [engine.to_json() for engine in self.engines],
            "shared_remote_store": self.store.to_json() if self.store is not None else None,
        }


def simulate_engines(
    config: KvSwapConfig,
    hardware: HardwareProfile,
    workload: Workload,
    *,
    num_engines: int,
    route: Route = Route.ROUND_ROBIN,
    store: SharedRemoteStore | None = None,
    own_tiers: Callable[[], Sequence[ModelledKeyedTier]] | None = None,
    options: SimOptions | None = None,
    progress: RequestProgress | None = None,
) -> MultiRun:
    """Serve `workload` on `num_engines` engines (sharing `store` when given, over the
    profile's remote link). `own_tiers`: called once per engine for keyed tiers of its
    own, in front of the store (a keyed NVMe slab: `kvswap.sim.keyed_tier`)."""
    if not 1 <= num_engines <= MAX_ENGINES:
        raise ValueError(f"num_engines = {num_engines}; allowed: 1..{MAX_ENGINES}")
    shares = split_workload(workload, num_engines, route, config.cache.kv_block_tokens)

    def engine(share: EngineShare) -> Simulator:
        if own_tiers is None:
            return Simulator(config, hardware, options=options, remote_store=store,
                             request_ids=share.request_ids)  # fmt: skip
        keyed = [*own_tiers(), *([ModelledKeyedTier(store)] if store is not None else [])]
        return Simulator(config, hardware, options=options, keyed=keyed,
                         request_ids=share.request_ids)  # fmt: skip

    simulators = [engine(share) for share in shares]
    finished = [0] * num_engines

    def engine_progress(index: int) -> RequestProgress:
        def update(done: int, _total: int) -> None:
            finished[index] = done
            if progress is not None:
                progress(sum(finished), len(workload))

        return update

    drivers = [
        simulator.driver(share.workload, engine_progress(index))
        for index, (simulator, share) in enumerate(zip(simulators, shares, strict=True))
    ]
    summaries: dict[int, RunSummary] = {}

    def done(index: int) -> None:
        # At once, not after the others: draining lets its last writes complete (each
        # visible from its own end time), as they would while the others run on.
        summaries[index] = drivers[index].summary()

    interleave([d.step for d in drivers], [s.now_s for s in simulators], done)
    engines = tuple(
        EngineRun(index, simulator, share.request_ids, summaries[index])
        for index, (simulator, share) in enumerate(zip(simulators, shares, strict=True))
    )
    return MultiRun(engines, route, store)


def interleave(
    steps: Sequence[Callable[[], bool]],
    clocks: Sequence[Callable[[], float]],
    done: Callable[[int], None],
) -> None:
    """Call `steps[i]()` for the i whose clock is earliest (ties: lowest i) until every
    step has returned False; `done(i)` right after step i returned False. Only the
    stepped engine's clock moves, so a heap keyed by (clock, index) stays exact."""
    heap = [(clock(), index) for index, clock in enumerate(clocks)]
    heapq.heapify(heap)
    while heap:
        _, index = heapq.heappop(heap)
        if steps[index]():
            heapq.heappush(heap, (clocks[index](), index))
        else:
            done(index)


def ratio(with_value: float, without_value: float) -> float | None:
    """with / without, rounded; None when `without_value` is 0."""
    return round(with_value / without_value, 4) if without_value else None


def compare_remote(
    with_store: dict[str, object], without_store: dict[str, object]
) -> dict[str, object]:
    """Two `combined()` objects side by side: the shared tier's effect as ratios
    (with the store / without it; below 1 is a saving for TTFT and prefill work,
    above 1 a gain for throughput)."""

    def pick(summary: dict[str, object], key: str, sub: str | None = None) -> float:
        value = summary[key]
        if sub is not None:
            assert isinstance(value, dict)
            value = value[sub]
        assert isinstance(value, int | float)
        return float(value)

    rows = {
        "ttft_p50_ms": ("ttft_ms", "p50"),
        "ttft_p99_ms": ("ttft_ms", "p99"),
        "throughput_tok_s": ("throughput_tok_s", None),
        "prefill_tokens_computed": ("prefill_tokens_computed", None),
    }
    return {
        name: {
            "with_remote": pick(with_store, key, sub),
            "without_remote": pick(without_store, key, sub),
            "ratio": ratio(pick(with_store, key, sub), pick(without_store, key, sub)),
        }
        for name, (key, sub) in rows.items()
    }
