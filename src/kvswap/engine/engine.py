"""The reference engine: a model, the tiered store, the driver loop, a wall clock.

    workload --> drive() --> Scheduler.schedule --> Engine.execute (ModelRunner) --> complete
                                  |   (swapper: swap-in, waits)     (swapper: offload, swap-out)
                                  '-- LocalCopyEngine: device pool <-> pinned pool <-> NVMe slab

The engine is the real `Backend` of the one driver loop (`kvswap.drive`):
a wall clock, the model, the copy engine. It is built from one frozen
`EngineSettings` record (`kvswap.engine.settings`: the edge reads the
configuration and the flags once). Everything is allocated once in `__init__`
at exactly the configured sizes, checked before anything is allocated: the
device pool, the pinned host pool, the NVMe slab. `close()` releases them (the
slab file is removed unless `nvme_persist`); so does a failure or a stop signal
part-way through `__init__`, on the same path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType

import torch

from kvswap.base.tier import Tier
from kvswap.base.transfer import CopyEngine
from kvswap.control.policy import named_policy
from kvswap.control.scheduler_records import StepPlan
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import DiskPool, check_directory, report_stale_slabs, slab_bytes
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import TierFactory, open_keyed_tiers, open_store_tier
from kvswap.data.tiered_copy import TieredCopyEngine
from kvswap.data.tiers.base import HostSlots, SecondaryTier
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.nvme_tier import NvmeTier
from kvswap.data.tiers.tier_list import merged_counters
from kvswap.drive.assembly import build_control_plane, keyed_tiers
from kvswap.drive.backend import Backend, StepOutput
from kvswap.drive.loop import drive
from kvswap.drive.summary import RunSummary
from kvswap.engine.runner import ModelRunner
from kvswap.engine.settings import EngineSettings, pick_device
from kvswap.errors import KvSwapError
from kvswap.host_memory import require_host_bytes
from kvswap.model.loader import load_model
from kvswap.obs.observer import StepObserver
from kvswap.openmp_env import model_threads
from kvswap.progress import RequestProgress
from kvswap.sampling import SamplingParams
from kvswap.signals import Terminated
from kvswap.workload.request import Workload

#: The longest the loop sleeps while idle, so an arrival is noticed promptly.
IDLE_SLICE_S = 0.05


class Engine(Backend):
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.device = pick_device(settings.device)
        self.layout = settings.layout
        self.capacities = settings.capacities
        self._check_tiers()  # before anything is allocated, weights included
        self._saved_threads = torch.get_num_threads()
        self.host_pool: HostPool | None = None
        self.disk_pool: DiskPool | None = None
        self.device_pool: DevicePool | None = None
        self.copy_engine: CopyEngine | None = None
        self.keyed: tuple[TierCopyEngine, ...] = ()  # the keyed tiers, fastest first
        try:
            self._allocate()
        except BaseException as exc:
            # A failure or a stop signal half-way: release what was made (the slab
            # among it) on the same path as close(), then let the error through.
            _note_released(exc, self.close())
            raise
        self._start_s = time.perf_counter()

    def _allocate(self) -> None:
        """Weights, then the NVMe slab, the pinned pool, the device pool, the copy engine."""
        settings, capacities = self.settings, self.capacities
        options = settings.options
        if self.device.type == "cpu":
            threads = model_threads(options.cpu_threads)
            if threads is not None:
                torch.set_num_threads(threads)
        model, arch = load_model(
            options.model, options.dtype, self.device, batch_invariant=settings.batch_invariant
        )
        self.model, self.arch = model, arch
        self.model_name = options.model
        if settings.nvme is not None:
            self.disk_pool = DiskPool(
                settings.nvme.directory, self.layout.block_bytes, capacities.num_nvme_blocks,
                persist=settings.nvme.persist, swept=True,  # by _check_tiers: report once
            )  # fmt: skip
        if capacities.num_cpu_blocks:
            self.host_pool = HostPool(self.layout, capacities.num_cpu_blocks)
        device_pool = DevicePool(self.layout, capacities.num_gpu_blocks, self.device)
        self.device_pool = device_pool
        local = LocalCopyEngine(
            device_pool, self.host_pool, prefetch_streams=settings.prefetch_stream_count
        )
        self.copy_engine = local
        copy_engine: CopyEngine = local
        if settings.control.remote is not None:
            self.keyed = self._open_keyed()
            copy_engine = self.copy_engine = TieredCopyEngine(local, self.keyed)
        keyed = keyed_tiers(
            settings.control, self.keyed, [engine.tier.write_policy for engine in self.keyed]
        )
        self.control = build_control_plane(
            settings.control, copy_engine, time.perf_counter, keyed=keyed
        )
        self.swapper, self.scheduler = self.control.swapper, self.control.scheduler
        self.runner = ModelRunner(model, device_pool.kv)

    def _open_keyed(self) -> tuple[TierCopyEngine, ...]:
        """The key-addressed tiers, fastest first, over the pinned pool: the shared store
        (tiers.remote_*), then the tiers of one's own (`tiers.secondary_tiers`, then
        `options.secondary_tiers`), each a keyed tier of the control plane. A store that is
        unusable is one line and exit 2 if `remote_required`, else a warning and that
        tier off until the store answers."""
        own = self.settings.secondary_tiers
        store = self.settings.remote_store
        if self.host_pool is None:
            named = "secondary_tiers" if own else "remote_url" if store else "the NVMe tier"
            raise KvSwapError(
                "the tiers below the pinned CPU pool move blocks through it: set "
                f"cpu_kv_capacity_blocks (or _bytes) > 0, or leave {named} unset"
            )
        opened = None
        if store is not None:
            opened = open_store_tier(
                store.url, self.host_pool, namespace=store.namespace,
                timeout_ms=store.timeout_ms, ttl_s=store.ttl_s,
                max_inflight_chunks=store.max_inflight_chunks, required=store.required,
            )  # fmt: skip
        slab: TierFactory | None = None
        disk = self.disk_pool
        if disk is not None:  # the engine's own NVMe slab, by key
            policy_name = self.settings.control.policy.policy_name(Tier.NVME)

            def slab(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
                policy = named_policy(Tier.NVME, policy_name, capacity_blocks=disk.num_slots)
                return NvmeTier(host_slots, disk, policy=policy, local=True)

        return open_keyed_tiers(opened, own, self.host_pool, slab=slab)

    def remote_counters(self) -> Mapping[str, int]:
        """The shared keyed tiers' data-plane counters (corrupt, skipped writes, outages,
        ...), as one record (`merged_counters`); empty without one. Not the NVMe slab's
        (`slab_counters`). For exporters, read at every step."""
        shared = [engine.tier for engine in self.keyed if not engine.tier.local]
        return merged_counters(shared) if shared else {}

    def slab_counters(self) -> Mapping[str, int]:
        """The NVMe slab's counters (written, hits, misses, corrupt, evicted, no room);
        empty without one."""
        return dict(self.keyed[0].tier.counters()) if self.keyed and self.keyed[0].local else {}

    def _check_tiers(self) -> None:
        """One-line errors for tiers that cannot be allocated, before any allocation."""
        caps, block = self.capacities, self.layout.block_bytes
        if caps.num_gpu_blocks < 1:
            raise KvSwapError(
                "gpu_kv_capacity_blocks (or gpu_kv_capacity_bytes) must give the engine at least "
                f"one GPU block of {block} bytes"
            )
        require_host_bytes(
            caps.num_cpu_blocks * block,
            f"cpu_kv_capacity = {caps.num_cpu_blocks} blocks x {block} bytes needs "
            f"{caps.num_cpu_blocks * block} bytes of pinned memory",
        )
        if self.settings.nvme is not None:
            nvme_dir = self.settings.nvme.directory
            report_stale_slabs(nvme_dir)  # their space counts as free in the check below
            check_directory(nvme_dir, slab_bytes(block, caps.num_nvme_blocks))

    def run(
        self,
        workload: Workload,
        progress: RequestProgress | None = None,
        observers: Sequence[StepObserver] = (),
        *,
        sampling: SamplingParams | None = None,
    ) -> RunSummary:
        """Serve every request of `workload`, each with `sampling` (None: greedy);
        returns the run summary."""
        if workload.vocab_size > self.arch.vocab_size:
            raise KvSwapError(
                f"workload {workload.name!r} uses token ids up to {workload.vocab_size - 1} but "
                f"the model's vocabulary has {self.arch.vocab_size} tokens"
            )
        return drive(
            self.control, self, workload, progress=progress, observers=observers,
            sampling=sampling,
        )  # fmt: skip

    # ------------------------------------------------------------------ Backend

    def start(self) -> None:
        self._start_s = time.perf_counter()

    def now_s(self) -> float:
        return time.perf_counter() - self._start_s

    def idle_until(self, t_s: float) -> None:
        time.sleep(max(0.0, min(t_s - self.now_s(), IDLE_SLICE_S)))

    def execute(self, plan: StepPlan) -> StepOutput:
        tables = {item.seq_id: self.swapper.gpu_block_table(item.seq_id) for item in plan.seqs}
        return self.runner.run(plan, tables)

    def summary_extras(self, duration_s: float) -> Mapping[str, object]:
        return {
            "device": self.device.type,
            "model": self.model_name,
            "preemption": self.settings.control.scheduler.preemption.value,
            "block_bytes": self.layout.block_bytes,
            "batch_invariant": self.settings.batch_invariant,
            **self._pool_sizes(),
            **{
                name: counters
                for name, counters in (
                    ("remote", self.remote_counters()),
                    ("nvme_slab", self.slab_counters()),
                )
                if counters
            },
        }

    def _pool_sizes(self) -> dict[str, object]:
        """Configured vs resident bytes of the pinned pool: they must be equal."""
        host = self.host_pool
        return {
            "pinned_pool_configured_bytes": host.configured_bytes if host else 0,
            "pinned_pool_resident_bytes": host.resident_bytes() if host else 0,
        }

    def close(self) -> list[str]:
        """Stop the copy workers, then release every pool; safe to call twice.

        Returns what was released, one phrase per pool, for the stop line."""
        torch.set_num_threads(self._saved_threads)
        released: list[str] = []
        if self.copy_engine is not None:
            self.copy_engine.close()  # first: no worker may touch a pool being released
            self.copy_engine = None
        else:
            for engine in self.keyed:
                engine.close()  # opened, but the tiered engine was never built
        self.keyed = ()
        if self.host_pool is not None:
            self.host_pool.close()
            released.append(f"released the pinned pool ({self.host_pool.configured_bytes} bytes)")
            self.host_pool = None
        if self.disk_pool is not None:
            disk = self.disk_pool
            disk.close()
            released.append(
                f"kept the NVMe slab {disk.path} (nvme_persist)"
                if disk.persist
                else f"removed the NVMe slab {disk.path}"
            )
            self.disk_pool = None
        if self.device_pool is not None:
            released.append(f"released the device pool ({self.device_pool.configured_bytes} bytes)")
            self.device_pool = None
        return released

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _note_released(exc, self.close())


def _note_released(exc: BaseException | None, released: list[str]) -> None:
    """Tell the stop line (kvswap.signals.stop_message) what was released."""
    if isinstance(exc, (KeyboardInterrupt, Terminated)) and released:
        exc.add_note(", ".join(released))
