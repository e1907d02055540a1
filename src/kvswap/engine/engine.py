"""The reference engine: a model, the tiered store, the driver loop, a wall clock.

    workload --> drive() --> Scheduler.schedule --> Engine.execute (ModelRunner) --> complete
                                  |   (swapper: swap-in, waits)     (swapper: offload, swap-out)
                                  '-- LocalCopyEngine: device pool <-> pinned pool <-> NVMe slab

The engine is the real `Backend` of the one driver loop (`kvswap.drive`):
a wall clock, the model, the copy engine. Everything is allocated once in
`__init__` at exactly the configured sizes, checked before anything is
allocated: the device pool, the pinned host pool, the NVMe slab. `close()`
releases them (the slab file is removed unless `nvme_persist`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvswap.config import KvSwapConfig
from kvswap.control.scheduler import StepPlan
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import DiskPool, check_directory, slab_bytes
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.pinned import available_host_bytes
from kvswap.drive.assembly import build_control_plane
from kvswap.drive.backend import Backend
from kvswap.drive.loop import drive
from kvswap.drive.settings import control_settings
from kvswap.drive.summary import RunSummary
from kvswap.engine.runner import ModelRunner
from kvswap.errors import KvSwapError
from kvswap.model.generate import SamplingParams
from kvswap.model.loader import load_model, resolve_model
from kvswap.obs.observer import StepObserver
from kvswap.progress import RequestProgress
from kvswap.workload.request import Workload

#: The longest the loop sleeps while idle, so an arrival is noticed promptly.
IDLE_SLICE_S = 0.05


@dataclass(frozen=True)
class EngineOptions:
    model: str = "small"
    dtype: str | None = None
    sampling: SamplingParams | None = None
    # Threads for the model on a CPU device. None: all cores but one, which the
    # copy workers need; on a 2-core machine torch's spinning threads otherwise
    # fight the copy threads and a step takes several times longer.
    cpu_threads: int | None = None


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise KvSwapError("device = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine(Backend):
    def __init__(self, config: KvSwapConfig, options: EngineOptions):
        self.config = config
        self.device = pick_device(config.engine.device)
        arch, _, _ = resolve_model(options.model, options.dtype)
        self.layout = KVLayout.for_model(arch.description, config.cache.kv_block_tokens)
        capacities = config.tier_capacities(self.layout.block_bytes)
        self.capacities = capacities
        self._check_tiers()  # before anything is allocated, weights included
        self._saved_threads = torch.get_num_threads()
        if self.device.type == "cpu":
            cores = os.cpu_count() or 1
            torch.set_num_threads(options.cpu_threads or max(1, cores - 1))
        model, arch = load_model(options.model, options.dtype, self.device)
        self.model, self.arch = model, arch
        self.model_name = options.model
        disk: DiskPool | None = None
        if capacities.num_nvme_blocks:
            assert config.tiers.nvme_dir is not None  # validated with the capacities
            disk = DiskPool(
                config.tiers.nvme_dir, self.layout.block_bytes, capacities.num_nvme_blocks,
                persist=config.tiers.nvme_persist,
            )  # fmt: skip
        host = (
            HostPool(self.layout, capacities.num_cpu_blocks) if capacities.num_cpu_blocks else None
        )
        self.device_pool = DevicePool(self.layout, capacities.num_gpu_blocks, self.device)
        self.host_pool, self.disk_pool = host, disk
        self.copy_engine = LocalCopyEngine(
            self.device_pool, host, disk, prefetch_streams=config.swap.prefetch_stream_count
        )
        settings = control_settings(
            config, capacities, block_bytes=self.layout.block_bytes,
            model_fingerprint=arch.description.fingerprint(),
        )  # fmt: skip
        self.control = build_control_plane(settings, self.copy_engine, time.perf_counter)
        self.swapper, self.scheduler = self.control.swapper, self.control.scheduler
        self.runner = ModelRunner(model, self.device_pool.kv, options.sampling)
        self._start_s = time.perf_counter()

    def _check_tiers(self) -> None:
        """One-line errors for tiers that cannot be allocated, before any allocation."""
        caps, block = self.capacities, self.layout.block_bytes
        if caps.num_gpu_blocks < 1:
            raise KvSwapError(
                "gpu_kv_capacity_blocks (or gpu_kv_capacity_bytes) must give the engine at least "
                f"one GPU block of {block} bytes"
            )
        free_bytes = available_host_bytes()
        if caps.num_cpu_blocks * block > free_bytes:
            raise KvSwapError(
                f"cpu_kv_capacity = {caps.num_cpu_blocks} blocks x {block} bytes needs "
                f"{caps.num_cpu_blocks * block} bytes of pinned memory but only {free_bytes} are "
                "available; lower the CPU tier capacity"
            )
        if caps.num_nvme_blocks:
            assert self.config.tiers.nvme_dir is not None  # validated with the capacities
            check_directory(
                Path(self.config.tiers.nvme_dir), slab_bytes(block, caps.num_nvme_blocks)
            )

    def run(
        self,
        workload: Workload,
        progress: RequestProgress | None = None,
        observers: Sequence[StepObserver] = (),
    ) -> RunSummary:
        """Serve every request of `workload`; returns the run summary."""
        if workload.vocab_size > self.arch.vocab_size:
            raise KvSwapError(
                f"workload {workload.name!r} uses token ids up to {workload.vocab_size - 1} but "
                f"the model's vocabulary has {self.arch.vocab_size} tokens"
            )
        return drive(self.control, self, workload, progress=progress, observers=observers)

    # ------------------------------------------------------------------ Backend

    def start(self) -> None:
        self._start_s = time.perf_counter()

    def now_s(self) -> float:
        return time.perf_counter() - self._start_s

    def idle_until(self, t_s: float) -> None:
        time.sleep(max(0.0, min(t_s - self.now_s(), IDLE_SLICE_S)))

    def execute(self, plan: StepPlan) -> Mapping[int, int]:
        tables = {item.seq_id: self.swapper.gpu_block_table(item.seq_id) for item in plan.seqs}
        return self.runner.run(plan, tables)

    def summary_extras(self, duration_s: float) -> Mapping[str, object]:
        return {
            "device": self.device.type,
            "model": self.model_name,
            "preemption": self.config.engine.preemption,
            "block_bytes": self.layout.block_bytes,
            **self._pool_sizes(),
        }

    def _pool_sizes(self) -> dict[str, object]:
        """Configured vs resident bytes of the pinned pool: they must be equal."""
        host = self.host_pool
        return {
            "pinned_pool_configured_bytes": host.configured_bytes if host else 0,
            "pinned_pool_resident_bytes": host.resident_bytes() if host else 0,
        }

    def close(self) -> None:
        torch.set_num_threads(self._saved_threads)
        self.copy_engine.close()
        if self.host_pool is not None:
            self.host_pool.close()
        if self.disk_pool is not None:
            self.disk_pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
