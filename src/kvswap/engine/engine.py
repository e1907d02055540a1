"""The reference engine: a model, the tiered store, the scheduler, a wall clock.

    workload --> arrivals --> Scheduler.schedule --> ModelRunner.run --> Scheduler.complete
                                  |   (swapper: swap-in, waits)     (swapper: offload, swap-out)
                                  '-- LocalCopyEngine: device pool <-> pinned pool <-> NVMe slab

Everything is allocated once in `__init__` at exactly the configured sizes,
checked before anything is allocated: the device pool, the pinned host pool,
the NVMe slab. `close()` releases them (the slab file is removed unless
`nvme_persist`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvswap.config import KvSwapConfig
from kvswap.control.policy import PolicyOptions
from kvswap.control.scheduler import Scheduler, SchedulerSettings
from kvswap.control.store import StoreLayout
from kvswap.control.swapper import Swapper, SwapSettings
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import DiskPool, check_directory, slab_bytes
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.pinned import available_host_bytes
from kvswap.engine.runner import ModelRunner
from kvswap.engine.summary import StepTotals, build_summary
from kvswap.errors import KvSwapError
from kvswap.model.generate import SamplingParams
from kvswap.model.loader import load_model, resolve_model
from kvswap.obs.observer import StepObserver, sample_step
from kvswap.workload.arrivals import ArrivalQueue
from kvswap.workload.request import Workload

#: Called after every step with (requests finished, requests in the workload).
Progress = Callable[[int, int], None]


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


class Engine:
    def __init__(self, config: KvSwapConfig, options: EngineOptions):
        self.config = config
        self.device = pick_device(config.engine.device)
        arch, torch_dtype, _ = resolve_model(options.model, options.dtype)
        self.layout = KVLayout(
            arch.num_layers, arch.num_kv_heads, arch.head_dim, config.cache.kv_block_tokens,
            torch_dtype,
        )  # fmt: skip
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
        self.copy_engine = LocalCopyEngine(self.device_pool, host, disk)
        swap = config.swap
        self.swapper = Swapper(
            StoreLayout(
                config.cache.kv_block_tokens, capacities.num_gpu_blocks, capacities.num_cpu_blocks,
                capacities.num_nvme_blocks, swap.evict_protected_blocks,
            ),
            PolicyOptions.from_config(config),
            SwapSettings.from_config(config, self.layout.block_bytes),
            self.copy_engine,
            clock_s=time.perf_counter,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.swapper,
            SchedulerSettings.from_config(config),
            clock_s=time.perf_counter,
        )
        self.runner = ModelRunner(model, self.device_pool.kv, options.sampling)

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
        progress: Progress | None = None,
        observers: Sequence[StepObserver] = (),
    ) -> dict[str, object]:
        """Serve every request of `workload`; returns the run summary. Each observer
        sees every step's sample, then the summary."""
        if workload.vocab_size > self.arch.vocab_size:
            raise KvSwapError(
                f"workload {workload.name!r} uses token ids up to {workload.vocab_size - 1} but "
                f"the model's vocabulary has {self.arch.vocab_size} tokens"
            )
        scheduler = self.scheduler
        arrivals = ArrivalQueue(workload)
        start_s = time.perf_counter()
        step_s = swap_wait_s = 0.0
        num_steps = 0
        while arrivals or scheduler.has_work():
            now_s = time.perf_counter() - start_s
            arrivals.admit_due(scheduler, now_s)
            next_s = arrivals.next_arrival_s()
            if not scheduler.has_work():
                if next_s is not None:
                    time.sleep(max(0.0, min(next_s - now_s, 0.05)))
                continue
            step_start_s = time.perf_counter()
            plan = scheduler.schedule(now_s)
            if not plan.seqs:
                if self.swapper.wait_any():
                    continue  # a transfer finished: room may have appeared
                if next_s is not None and next_s > now_s:
                    time.sleep(min(next_s - now_s, 0.05))
                    continue
                raise KvSwapError(
                    "the engine cannot make progress: the GPU tier is held by paused sequences "
                    "and nothing can move; add CPU or NVMe capacity or lower max_num_seqs"
                )
            tables = {
                item.seq_id: self.swapper.store.gpu_block_table(item.seq_id) for item in plan.seqs
            }
            sampled = self.runner.run(plan, tables)
            done_s = time.perf_counter()
            finished = scheduler.complete(plan, sampled, done_s - start_s)
            this_step_s = time.perf_counter() - step_start_s
            step_s += this_step_s
            swap_wait_s += plan.swap_wait_s
            num_steps += 1
            if observers:
                sample = sample_step(
                    scheduler, plan, finished, t_s=done_s - start_s, step_s=this_step_s,
                    step_total_s=step_s, swap_wait_total_s=swap_wait_s,
                )  # fmt: skip
                for observer in observers:
                    observer.on_step(sample)
            for seq_id in finished:
                arrivals.finished(seq_id, scheduler.runs[seq_id].output_ids, done_s - start_s)
            if progress is not None:
                progress(len(scheduler.finished), len(workload))
        self.swapper.drain()
        if progress is not None:
            progress(len(scheduler.finished), len(workload))
        duration_s = time.perf_counter() - start_s
        summary = build_summary(
            scheduler,
            duration_s,
            StepTotals(num_steps, step_s, swap_wait_s),
            {
                "device": self.device.type,
                "model": self.model_name,
                "preemption": self.config.engine.preemption,
                "block_bytes": self.layout.block_bytes,
                **self._pool_sizes(),
            },
        )
        for observer in observers:
            observer.on_finish(summary)
        return summary

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
