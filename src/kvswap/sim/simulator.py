"""The discrete-event simulator: the engine's loop with a cost model for a model.

    workload --> drive() --> Scheduler.schedule --> StepCostModel --> Scheduler.complete
                                  |  (swap-in, waits)         clock += step   (offload, swap-out)
                                  '-- ModelledCopyEngine: links on the VirtualClock

The simulator is the modelled `Backend` of the one driver loop
(`kvswap.drive`); the scheduler, swapper, store and policy are the engine's
own objects, built by the same assembly from the same config; only the data
plane is modelled. Nothing is computed: a sampled token is a placeholder that depends
on (sequence, position) only, so later turns of a conversation still extend
their own history. Time is virtual: a step lasts what the cost model says, a
wait for a transfer jumps to its modelled end, an idle gap jumps to the next
arrival. Same seed, same run.

With a `SharedRemoteStore` the engine also has a remote tier: its swapper asks
the store through this engine's `RemoteStoreView` (a `RemoteIndex`), and its
copy engine moves remote chunks on the profile's remote link. Several
simulators can share one store (`kvswap.sim.multi`); each has its own clock,
and `driver()` hands out the loop one step at a time so they can be
interleaved. Without a store nothing of this exists and the summary is the
same as before the remote tier was modelled.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, TransferChunk
from kvswap.config import KvSwapConfig
from kvswap.control.blocks import Block
from kvswap.control.policy import PolicyOptions, named_policy
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import StepPlan
from kvswap.drive.assembly import build_control_plane, keyed_tiers
from kvswap.drive.backend import Backend, StepOutput
from kvswap.drive.loop import Driver, drive
from kvswap.drive.settings import control_settings, policy_options
from kvswap.drive.summary import RunSummary
from kvswap.model.description import ModelDescription
from kvswap.model.kv_identity import kvswap_identity
from kvswap.obs.observer import StepObserver
from kvswap.progress import RequestProgress
from kvswap.sim.clock import VirtualClock
from kvswap.sim.copy_model import ModelledCopyEngine
from kvswap.sim.cost import StepCostModel
from kvswap.sim.hardware import HardwareProfile
from kvswap.sim.keyed_tier import KeyedLink, ModelledKeyedTier
from kvswap.sim.remote_store import SharedRemoteStore
from kvswap.sim.setup import resolve_setup
from kvswap.workload.arrivals import ArrivalQueue
from kvswap.workload.request import Workload


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a run allocates millions of short-lived objects
    (facts, copies, chunks): reference counting frees them all, since a run makes no
    reference cycles (a block points to its parent, never back; a test checks that a run
    leaves no cyclic garbage). The collector would only rescan the live blocks: 58 s of
    a full `sim_scale.py` run's 692 even with its first generation collected 70x less
    often; without it the run takes ~11% less wall time at the same peak memory. Changes no
    simulated figure: nothing depends on when garbage is collected. A caller that had
    disabled the collector keeps it disabled; cycles a user's own policy makes are
    collected after the run."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class SimOptions:
    pinned_host: bool = True  # False: pageable host memory (lower bandwidth, jitter)
    seed: int | None = None  # None: the config's [simulator] seed
    policy: PolicyOptions | None = None  # None: the engine's policy for the config
    ping_pong_window_steps: int = 64  # a swap-in this soon after the last one is a re-swap


def placeholder_token(seq_id: int, position: int, vocab_size: int) -> int:
    """The 'sampled' token: a fixed function of (sequence, position)."""
    mixed = (seq_id * 0x9E3779B1 + position * 0x85EBCA77 + 0x165667B1) & 0xFFFF_FFFF
    return (mixed ^ (mixed >> 15)) % vocab_size


def blocked_summary(delays_s: Sequence[float]) -> dict[str, object]:
    """Swap-out chunks that made a swap-in wait (a DMA chunk is never preempted):
    how many, and the waits they imposed in total and at worst."""
    return {
        "num_chunks": len(delays_s),
        "total_ms": round(sum(delays_s) * 1e3, 3),
        "max_ms": round(max(delays_s, default=0.0) * 1e3, 3),
    }


class SwapInTap:
    """Counts swap-ins per block as chunks are submitted (the mover's submit hook):
    sink-block swap-ins (blocks among some sequence's protected first blocks) and
    re-swaps (a block swapped in again within `window_steps` steps of its previous
    swap-in: ping-pong)."""

    def __init__(self, window_steps: int):
        self.window_steps = window_steps
        self.scheduler: Scheduler | None = None  # its step numbers the swap-ins
        self.blocks_swapped_in = 0
        self.sink_block_swap_ins = 0
        self.re_swaps = 0
        self._last_swap_in_step: dict[int, int] = {}

    def __call__(self, chunk: TransferChunk, blocks: Sequence[Block]) -> None:
        if chunk.direction is not Direction.CPU_TO_GPU:
            return
        step = self.scheduler.step if self.scheduler is not None else 0
        for block in blocks:
            self.blocks_swapped_in += 1
            if block.num_protected_refs > 0:
                self.sink_block_swap_ins += 1
            last = self._last_swap_in_step.get(block.block_id)
            if last is not None and step - last < self.window_steps:
                self.re_swaps += 1
            self._last_swap_in_step[block.block_id] = step


class Simulator(Backend):
    def __init__(
        self,
        config: KvSwapConfig,
        hardware: HardwareProfile,
        *,
        shape: ModelDescription | None = None,
        options: SimOptions | None = None,
        remote_store: SharedRemoteStore | None = None,
        keyed: Sequence[ModelledKeyedTier] = (),
        request_ids: Sequence[int] | None = None,
    ):
        """`remote_store`: the shared store this engine's keyed tier uses, over the
        profile's remote link (None: no shared store, whatever `tiers.remote_url` says).
        `keyed`: the keyed tiers instead, fastest first, each with its store, link and
        write policy (`kvswap.sim.keyed_tier`). With NVMe blocks configured, the
        engine's own slab by key goes in front of them (`ModelledKeyedTier.slab`).
        `request_ids`: the
        workload-wide id of each of this engine's requests (its workload numbers
        them 0..n-1); placeholder tokens follow them, so engines that split a
        workload generate the tokens one engine would."""
        options = options if options is not None else SimOptions()
        self.config = config
        self.options = options
        self.setup = setup = resolve_setup(config, hardware, shape)
        self.clock = VirtualClock()
        self.tap = SwapInTap(options.ping_pong_window_steps)
        if remote_store is not None:
            if keyed:
                raise ValueError("give remote_store or keyed tiers, not both")
            keyed = (ModelledKeyedTier(remote_store),)
        policy = options.policy if options.policy is not None else policy_options(config)
        num_nvme_blocks = setup.capacities.num_nvme_blocks
        if num_nvme_blocks:  # ranked as the engine's slab is, by nvme_eviction_policy
            slab_policy = named_policy(
                Tier.NVME, policy.policy_name(Tier.NVME), capacity_blocks=num_nvme_blocks
            )
            slab = ModelledKeyedTier.slab(num_nvme_blocks, setup.block_bytes, hardware, slab_policy)
            keyed = (slab, *keyed)
        links = [each.link or KeyedLink.remote(hardware) for each in keyed]
        # Each keyed tier's view of its store, on this engine's clock.
        self.views = tuple(
            each.store.view(self.clock, lookup_rtt_s=link.lookup_s)
            for each, link in zip(keyed, links, strict=True)
        )
        self.copy_engine = ModelledCopyEngine(
            hardware, self.clock, pinned_host=options.pinned_host,
            prefetch_streams=config.swap.prefetch_stream_count,
            seed=config.simulator.seed if options.seed is None else options.seed,
            keyed=list(zip(self.views, links, strict=True)),
            remote_streams=config.tiers.remote_max_inflight_chunks,
        )  # fmt: skip
        # No weights run here: the architecture (in the KV dtype) names the blocks.
        fingerprint = kvswap_identity(
            setup.shape, None, batch_invariant=config.engine.batch_invariant,
            device_type="simulated", block_tokens=config.cache.kv_block_tokens,
            block_bytes=setup.block_bytes,
        ).fingerprint()  # fmt: skip
        settings = control_settings(
            config, setup.capacities, block_bytes=setup.block_bytes,
            model_fingerprint=fingerprint, policy=policy,
            shared_store=bool(self.views),
        )  # fmt: skip
        self.control = build_control_plane(
            settings, self.copy_engine, self.clock, on_submit=self.tap,
            keyed=keyed_tiers(settings, self.views, [each.write_policy for each in keyed]),
        )  # fmt: skip
        self._request_ids = tuple(request_ids) if request_ids is not None else None
        self.tokens_computed = 0  # every token of every step's forward pass
        self.swapper, self.scheduler = self.control.swapper, self.control.scheduler
        self._vocab_size = 0
        self._wall_start_s = time.perf_counter()
        self.tap.scheduler = self.scheduler
        self.cost = StepCostModel(setup.shape, setup.dtype, hardware)

    def run(
        self,
        workload: Workload,
        progress: RequestProgress | None = None,
        observers: Sequence[StepObserver] = (),
    ) -> RunSummary:
        """Serve every request of `workload` in virtual time; returns the summary
        (the keys of `kvswap run --json` plus the simulator's own)."""
        self._start_workload(workload)
        with paused_gc():
            return drive(self.control, self, workload, progress=progress, observers=observers)

    def driver(self, workload: Workload, progress: RequestProgress | None = None) -> Driver:
        """The loop over `workload`, one `step()` at a time (`run` runs it to the end);
        `summary()` once `step()` returned False."""
        self._start_workload(workload)
        return Driver(
            self.control, self, ArrivalQueue(workload), num_requests=lambda: len(workload),
            progress=progress,
        )  # fmt: skip

    def _start_workload(self, workload: Workload) -> None:
        if self._request_ids is not None and len(self._request_ids) != len(workload):
            raise ValueError(
                f"{len(self._request_ids)} request ids for a workload of {len(workload)}"
            )
        self._vocab_size = workload.vocab_size

    # ------------------------------------------------------------------ Backend

    def start(self) -> None:
        self._wall_start_s = time.perf_counter()

    def now_s(self) -> float:
        return self.clock.now_s

    def idle_until(self, t_s: float) -> None:
        self.clock.advance_to(t_s)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.clock.advance(self.cost.step_s(plan.seqs))
        self.tokens_computed += sum(len(item.token_ids) for item in plan.seqs)
        ids = self._request_ids
        sampled = {
            item.seq_id: placeholder_token(
                item.seq_id if ids is None else ids[item.seq_id],
                item.start_position + len(item.token_ids),
                self._vocab_size,
            )
            for item in plan.seqs
            if item.samples
        }
        return StepOutput(sampled)

    def summary_extras(self, duration_s: float) -> Mapping[str, object]:
        wall_s = time.perf_counter() - self._wall_start_s
        setup, scheduler = self.setup, self.scheduler
        cpu_pool_bytes = setup.capacities.num_cpu_blocks * setup.block_bytes
        pinned_bytes = cpu_pool_bytes if self.options.pinned_host else 0
        prompt_tokens = sum(
            len(run.prompt_ids) for run in scheduler.runs.values() if run.rejected_reason is None
        )
        hits = self.swapper.metrics.prefix_hit_blocks_by_tier
        block_tokens = setup.config.cache.kv_block_tokens
        busy = self.copy_engine.busy_s_by_link()
        extras: dict[str, object] = {
            "device": "simulated",
            "hardware": setup.hardware.name,
            "model": setup.shape.name,
            "preemption": setup.config.engine.preemption,
            "block_bytes": setup.block_bytes,
            "host_memory": "pinned" if self.options.pinned_host else "pageable",
            "pinned_pool_configured_bytes": pinned_bytes,
            "pinned_pool_resident_bytes": pinned_bytes,
            "prefix_hit_rate_by_tier": {
                tier.value: round(hits[tier] * block_tokens / prompt_tokens, 6)
                if prompt_tokens
                else 0.0
                for tier in self.swapper.metrics.tiers
            },
            "link_utilization": {
                name: round(seconds / duration_s, 6) if duration_s > 0 else 0.0
                for name, seconds in busy.items()
            },
            "swap_in_blocked_by_swap_out": blocked_summary(self.copy_engine.high_blocked_by_low_s),
            "blocks_swapped_in": self.tap.blocks_swapped_in,
            "sink_block_swap_ins": self.tap.sink_block_swap_ins,
            "re_swaps": self.tap.re_swaps,
            "wall_s": round(wall_s, 3),
            "simulated_s_per_wall_s": round(duration_s / wall_s, 3) if wall_s > 0 else 0.0,
        }
        # The data plane's side of this engine's keyed tiers: the slab's counters apart;
        # the shared ones' summed (the summary's `remote` object merges them with the
        # control plane's figures), each one's own when there are several.
        pairs = zip(self.swapper.remotes, self.views, strict=True)
        shared = [(remote.tier, view) for remote, view in pairs if not view.local]
        for view in self.views:
            if view.local:
                extras["nvme_slab"] = view.counters.to_json()
        if shared:
            views = [view for _, view in shared]
            extras["remote"] = {
                "already_present": sum(view.counters.already_present for view in views),
                "evictions": sum(view.counters.evictions for view in views),
                "evicted_bytes": sum(view.counters.evicted_bytes for view in views),
                "lookup_wait_us": round(sum(view.counters.lookup_wait_s for view in views) * 1e6),
            }
            if len(shared) > 1:
                extras["keyed_tiers"] = {t.value: view.counters.to_json() for t, view in shared}
        return extras
