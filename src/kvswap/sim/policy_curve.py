"""Host-tier eviction policies side by side: a prefix-hit curve per policy over tier sizes.

vLLM exposes one tier to a policy, its host (CPU) tier, and its users choose
"lru" or "arc" for it. Here the pinned pool plays that tier: the same seeded
multi-turn chat runs through the engine's control plane once per
`cpu_eviction_policy` ("kvswap", "lru", "arc", "reuse") and host-tier size, with
everything else equal; the GPU tier keeps kvswap's policy in every run and is
small on purpose, so that most reuse has to come back through the host tier.

A host tier replaces: vLLM's evicts its policy's victims for every new store.
kvswap's pinned pool with nothing below it does so only when it holds at least
half the GPU tier's blocks (`demotion.DISPLACING_POOL_FRACTION`): the GPU's
victims then displace its cache entries as its policy ranks them. A smaller
pool never discards one unreferenced cache entry to take in another
(`room.make_room`); it takes a new one only by dropping a copy that also lives
on the GPU, and only when that copy is the policy's first offer. LRU and ARC
sometimes offer one; kvswap's policy offers its discardable cache entries
first, so with it such a pool keeps what it holds, and the policy decides
little but whether the pool replaces at all. So the comparison runs the pool with a
small NVMe spill below it (`SPILL_BLOCKS`): past `cpu_demote_high_watermark`
the pool demotes its policy's victims there (and the spill discards its oldest
for newer ones), which makes the pool a replacing tier whose victims the CPU
policy picks. The spill's own hits are counted apart (its tier) and are small.
`spill=False` runs the pool as it is.

Each point is a `HitRatePoint` (the hit-rate tool's point, sim/hit_rate.py) at
the host tier's size in tokens: prefix-hit tokens over prompt tokens, here
from the simulator's control plane instead of the trace-only LRU model.

Inside vLLM (the comparison's second half, `benchmarks/vllm_policy_hits.py`,
its figures in the README beside these): the same workload, scaled down
(`chat_workload(CHAT)`'s shape; later turns resolve their prompts at run time,
as `kvswap loadgen` replays them), vLLM's host tier sized to each host size x
the block bytes (`cpu_bytes_to_use`), kvswap's policy through the integration
against vLLM's own "lru" and "arc" (vLLM's own manager and policy classes,
behind kvswap's spec and worker: vLLM's own worker refuses the CPU platform),
and per request vLLM's `num_cached_tokens` (prefix-hit tokens; prompt minus
them: prefill computed). vLLM's host tier replaces by itself, so it needs no
spill; its device prefix cache is vLLM's, not kvswap's policy, so the device's
share of the hits differs from these runs'.

The working set is the live reusable KV: for each session between one turn's
end and the next turn's admission, the blocks that next turn reuses (its
context so far, system prompt apart), plus each system prompt once; averaged
over the run with an unlimited host tier (`live_reuse_blocks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvswap.base.tier import BUILT_IN_TIERS
from kvswap.config import KvSwapConfig
from kvswap.config_load import load_config
from kvswap.control.scheduler_records import SequenceRun
from kvswap.sim.hardware import hardware_preset
from kvswap.sim.hit_rate import HitRatePoint
from kvswap.sim.simulator import Simulator
from kvswap.units import ceil_div
from kvswap.workload.request import Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

#: The policies compared: kvswap's and the two vLLM users choose between.
POLICIES = ("kvswap", "lru", "arc", "reuse")
#: kvswap's own of them, each compared with the better of vLLM's two (lru, arc).
OURS = ("kvswap", "reuse")
#: NVMe blocks below the pinned pool, so that it replaces (see the module docstring).
SPILL_BLOCKS = 64
#: Evictions from the host tier, by the metrics' reasons: what makes it replace
#: ("demote_remote": written to a keyed tier on its way out, the NVMe spill by key).
HOST_EVICTION_REASONS = ("demote_remote", "demote_drop", "cpu_drop", "cpu_discard")


@dataclass(frozen=True)
class CurveShape:
    """What runs: the workload, the model and machine, the GPU tier."""

    workload: SyntheticSpec
    gpu_blocks: int
    block_tokens: int = 16
    preset: str = "article-8b"
    dtype: str = "fp16"
    hardware: str = "h200"

    def config(self, policy: str, host_blocks: int, *, spill: bool) -> KvSwapConfig:
        overrides: dict[str, object] = {
            "preset": self.preset, "dtype": self.dtype, "kv_block_tokens": self.block_tokens,
            "gpu_kv_capacity_blocks": self.gpu_blocks, "cpu_kv_capacity_blocks": host_blocks,
            "cpu_eviction_policy": policy, "gpu_eviction_policy": "kvswap",
            "nvme_kv_capacity_blocks": SPILL_BLOCKS if spill else 0,
        }  # fmt: skip
        if spill:
            overrides["nvme_dir"] = "/var/tmp/kvswap"  # modelled: nothing is written
        return load_config(None, overrides=overrides)

    def to_json(self) -> dict[str, object]:
        return {
            "workload": dataclasses.asdict(self.workload), "gpu_blocks": self.gpu_blocks,
            "block_tokens": self.block_tokens, "preset": self.preset, "dtype": self.dtype,
            "hardware": self.hardware, "spill_blocks": SPILL_BLOCKS,
            "gpu_eviction_policy": "kvswap",
        }  # fmt: skip


#: A steady multi-turn chat: sessions start for ~8 minutes, live ~3 minutes each
#: (6 turns, 30 s think time), ~100 in progress at a time.
CHAT = CurveShape(
    SyntheticSpec(
        num_sessions=240, turns_per_session=6, prompt_tokens=1024, output_tokens=128,
        user_tokens_per_turn=64, system_prompt_tokens=512, num_system_prompts=4,
        arrival_rate_per_s=0.5, think_time_s=30.0, length_jitter=0.3, seed=0,
    ),
    gpu_blocks=1024,
)  # fmt: skip
#: Test scale: the same shape, a twentieth of the sessions and a third of the think time.
CHAT_QUICK = CurveShape(
    dataclasses.replace(CHAT.workload, num_sessions=12, think_time_s=10.0), gpu_blocks=512
)


@dataclass(frozen=True)
class PolicyRun:
    """One simulated run: a policy on a host tier of `host_blocks`."""

    policy: str
    host_blocks: int
    spill: bool
    point: HitRatePoint  # capacity: the host tier in tokens; reused: prefix-hit tokens
    hit_tokens_by_tier: Mapping[str, int]
    prefill_tokens_computed: int  # prompt tokens minus prefix hits
    recomputed_tokens: int  # tokens computed again after a recompute preemption
    host_evictions: int  # copies the host tier let go (HOST_EVICTION_REASONS)
    preemptions: int

    @property
    def hit_tokens(self) -> int:
        return self.point.reused_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy, "host_blocks": self.host_blocks, "spill": self.spill,
            "hit_rate": round(self.point.hit_rate, 6), "hit_tokens": self.hit_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
            "prompt_tokens": self.point.prompt_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "recomputed_tokens": self.recomputed_tokens, "host_evictions": self.host_evictions,
            "preemptions": self.preemptions,
        }  # fmt: skip


def simulate_policy(
    shape: CurveShape, workload: Workload, policy: str, host_blocks: int, *, spill: bool
) -> tuple[PolicyRun, Simulator]:
    """Run `workload` with `policy` on a host tier of `host_blocks`."""
    simulator = Simulator(
        shape.config(policy, host_blocks, spill=spill), hardware_preset(shape.hardware)
    )
    summary = simulator.run(workload)
    runs = list(simulator.scheduler.runs.values())
    prompt_tokens = sum(len(run.prompt_ids) for run in runs)
    hits = dict.fromkeys((tier.value for tier in BUILT_IN_TIERS), 0)
    hits |= {tier.value: tokens for tier, tokens in summary.prefix_hit_tokens.items()}
    hit_tokens = sum(hits.values())
    capacity_tokens = host_blocks * shape.block_tokens
    point = HitRatePoint(
        float(capacity_tokens), hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        hit_tokens, prompt_tokens,
    )  # fmt: skip
    evictions = summary.evictions_by_reason
    run = PolicyRun(
        policy=policy, host_blocks=host_blocks, spill=spill, point=point,
        hit_tokens_by_tier=hits,
        prefill_tokens_computed=sum(len(r.prompt_ids) - r.prefix_hit_tokens for r in runs),
        recomputed_tokens=summary.recomputed_tokens,
        host_evictions=sum(evictions.get(reason, 0) for reason in HOST_EVICTION_REASONS),
        preemptions=summary.preemptions,
    )  # fmt: skip
    return run, simulator


@dataclass(frozen=True)
class WorkingSet:
    """The live reusable KV of a run, in blocks (see the module docstring)."""

    mean_blocks: float
    peak_blocks: int


def reusable_blocks(
    prompt_tokens: int, output_tokens: int, block_tokens: int, system_blocks: int
) -> int:
    """The full blocks a turn leaves for its follow-up: its prompt and output but the last
    sampled token (never fed back), less the shared system prompt's blocks."""
    computed_tokens = prompt_tokens + output_tokens - 1
    return max(0, computed_tokens // block_tokens - system_blocks)


def live_blocks(
    intervals: Iterable[tuple[float, float, int]], duration: float, shared_blocks: int
) -> WorkingSet:
    """The time-averaged and peak sum of `(from, until, blocks)` intervals over
    `duration` (any unit of time, the intervals' own), plus `shared_blocks` always live."""
    events: list[tuple[float, int]] = []
    for start, end, blocks in intervals:
        events += [(start, blocks), (end, -blocks)]
    events.sort()
    live = peak = 0
    area = last = 0.0  # live blocks x time
    for time, change in events:
        area += live * (time - last)
        live += change
        peak = max(peak, live)
        last = time
    mean = area / duration if duration > 0 else 0.0
    return WorkingSet(mean + shared_blocks, peak + shared_blocks)


def live_reuse_blocks(
    workload: Workload, runs: Mapping[int, SequenceRun], spec: SyntheticSpec, block_tokens: int
) -> WorkingSet:
    """The working set of a run of `workload` (a synthetic chat made from `spec`): each
    turn's reusable blocks, live from its finish to its follow-up's admission."""
    system_blocks = spec.system_prompt_tokens // block_tokens
    intervals: list[tuple[float, float, int]] = []
    end_s = 0.0
    for request in workload.requests:
        run = runs[request.request_id]
        end_s = max(end_s, run.finish_s or 0.0)
        if request.follow_up is None:
            continue
        previous = runs[request.follow_up.previous_request_id]
        if previous.finish_s is None or run.admitted_s is None:
            continue
        blocks = reusable_blocks(
            len(previous.prompt_ids), len(previous.output_ids), block_tokens, system_blocks
        )
        intervals.append((previous.finish_s, run.admitted_s, blocks))
    shared = min(spec.num_system_prompts, spec.num_sessions) * system_blocks
    return live_blocks(intervals, end_s, shared)


def chat_workload(shape: CurveShape) -> Workload:
    return generate_synthetic(shape.workload)


def unlimited_host_blocks(shape: CurveShape) -> int:
    """A host tier that holds every block the workload makes: no session's longest
    context is longer than the bill's longest request."""
    spec = shape.workload
    longest_blocks = ceil_div(spec.bill().longest_request_tokens, shape.block_tokens)
    system_blocks = ceil_div(spec.system_prompt_tokens, shape.block_tokens)
    return spec.num_sessions * longest_blocks + spec.num_system_prompts * system_blocks
