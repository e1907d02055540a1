"""`KvswapConnector`: vLLM's offloading connector, loading small hits within their step.

vLLM 0.32's offloading connector loads every hit below the device pool between
engine steps: the request is scheduled, its chunks are copied while the next
step runs, and it computes the step after. A hit from the host tier so starts
a step later than one the device pool's prefix cache serves. vLLM 0.33's
connector can instead load a hit *synchronously*, before the forward pass of the
step that schedules it, for as many bytes a step as `sync_load_budget_bytes`
allows (0, its default: never). This class gives vLLM 0.32 that key with that
meaning; on a vLLM whose connector reads the key itself it adds nothing.

    kv_transfer_config = {"kv_connector": "KvswapConnector",
        "kv_connector_module_path": "kvswap.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvswapOffloadingSpec",
            "spec_module_path": "kvswap.integrations.vllm", "cpu_bytes_to_use": 4 << 30,
            "sync_load_budget_bytes": 64 << 20}}

What a synchronous load costs: the step that schedules it waits for the copy
before its forward pass (every request in the batch waits), which the budget
bounds. What it buys: the request computes in the step that scheduled it.

How it runs on 0.32 (the scheduler's state is vLLM's; this class only steers it):
- `get_num_new_matched_tokens` answers "not asynchronous" for a hit that fits the
  step's budget and leaves at least one token to compute;
- vLLM then caches the request's new blocks at once, so the connector's
  `update_state_after_alloc`, which loads into the blocks that have no hash yet,
  is shown them without their hashes; the load job it builds is taken out of
  the scheduler's pending jobs (vLLM 0.32 allows no store beside a pending load)
  and completed here when the worker reports it;
- the worker waits for that job in `start_load_kv` (vLLM calls it before the
  forward pass on a step with synchronous loads) and does not report the
  request as received (vLLM 0.32 would take it for an asynchronous one);
- a hit on kvswap's NVMe slab or store must first be promoted to the host tier:
  vLLM's tiering manager queues the promotion, submits it at the step's end and
  defers the request, which looks again a step later (or more, while the read
  runs). Where the promotion fits the step's budget too, the connector submits
  it at once, waits for it (`KvswapTieringManager.promote_now`) and looks the
  hit up again in the same step. The step then waits for the read as well as the
  copy: the stats line says how long, in all.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    _group_kv_bytes_per_block,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks

from kvswap.integrations.vllm.host_report import StatsCadence, SyncLoadCounts
from kvswap.integrations.vllm.manager import KvswapTieringManager
from kvswap.integrations.vllm.settings import sync_load_budget_bytes
from kvswap.units import ceil_div, format_bytes

LOGGER = logging.getLogger("vllm.kvswap")
#: Whether this vLLM's connector loads within the step itself (vLLM 0.33 does).
NATIVE_SYNC_LOADS = hasattr(OffloadingConnectorScheduler, "_reserve_sync_load")
#: Set while a KvswapConnector builds vLLM's parts (the spec among them).
_BUILDING = ContextVar("kvswap_connector_building", default=False)


def loads_within_step_read() -> bool:
    """Whether the connector building the spec now reads `sync_load_budget_bytes`:
    vLLM's own from 0.33 on, kvswap's on 0.32."""
    return NATIVE_SYNC_LOADS or _BUILDING.get()


@dataclass
class KvswapConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's metadata, and which of its load jobs the worker waits for in the step."""

    sync_load_jobs: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _UnhashedBlock:
    """A block as `update_state_after_alloc` reads it, before vLLM hashed it."""

    block_id: int
    is_null: bool
    block_hash: None = None


@dataclass
class _TakenJob:
    """A synchronous load job taken out of the scheduler's pending jobs."""

    keys: set[Any]
    req_context: Any


@dataclass
class _SchedulerSide:
    """The scheduler's side of synchronous loads (vLLM 0.32)."""

    budget_bytes: int
    kv_bytes_per_token: int
    step_bytes: int = 0
    step_requests: set[str] = field(default_factory=set)
    step_jobs: set[int] = field(default_factory=set)
    taken: dict[int, _TakenJob] = field(default_factory=dict)
    counts: SyncLoadCounts = field(default_factory=SyncLoadCounts)
    cadence: StatsCadence = field(init=False)

    def __post_init__(self) -> None:
        self.cadence = StatsCadence(self.counts)

    def end_step(self) -> None:
        """Ready for the next step; the stats line, as often as vLLM writes its own,
        when anything changed."""
        self.step_bytes, self.step_requests, self.step_jobs = 0, set(), set()
        if self.cadence.due(self.counts):
            LOGGER.info(self.counts.line())

    def reserve(self, request: Any, num_computed_tokens: int, num_hit_tokens: int) -> bool:
        """Whether this hit loads within the step: it fits what is left of the step's
        budget, and leaves a token to compute (vLLM schedules none otherwise)."""
        if num_computed_tokens + num_hit_tokens >= request.num_tokens or not self.reserve_bytes(
            num_hit_tokens * self.kv_bytes_per_token
        ):
            return False
        self.step_requests.add(request.request_id)
        return True

    def reserve_bytes(self, num_bytes: int) -> bool:
        """Whether `num_bytes` more fit this step's budget (then they are counted in)."""
        if self.step_bytes + num_bytes > self.budget_bytes:
            return False
        self.step_bytes += num_bytes
        return True


class KvswapConnector(OffloadingConnector):
    """vLLM's `OffloadingConnector`, with `sync_load_budget_bytes` on vLLM 0.32 too."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        building = _BUILDING.set(True)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _BUILDING.reset(building)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        budget_bytes = sync_load_budget_bytes(extra)
        self._sync: _SchedulerSide | None = None
        if self.connector_scheduler is not None and budget_bytes and not NATIVE_SYNC_LOADS:
            self._sync = _SchedulerSide(budget_bytes, _kv_bytes_per_token(kv_cache_config))
            LOGGER.info(
                "kvswap connector: a hit below the device pool loads within the step that "
                "schedules it, up to %s a step (sync_load_budget_bytes)",
                format_bytes(budget_bytes),
            )
        # The worker's side: this step's synchronous jobs and their requests.
        self._waited_requests: set[str] = set()

    @property
    def sync_load_counts(self) -> SyncLoadCounts | None:
        """Loads within and between steps so far (None: vLLM's own way runs)."""
        return None if self._sync is None else self._sync.counts

    def shutdown(self) -> None:
        if self._sync is not None and self._sync.cadence.changed(self._sync.counts):
            LOGGER.info(self._sync.counts.line())
        super().shutdown()

    # --- the scheduler's side -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        num_hit_tokens, load_async = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        sync = self._sync
        if sync is not None and num_hit_tokens is None and self._promoted_now(sync, request):
            num_hit_tokens, load_async = super().get_num_new_matched_tokens(
                request, num_computed_tokens
            )
        if sync is None or not num_hit_tokens or not load_async:
            return num_hit_tokens, load_async
        if sync.reserve(request, num_computed_tokens, num_hit_tokens):
            return num_hit_tokens, False
        return num_hit_tokens, True

    def _promoted_now(self, sync: _SchedulerSide, request: Any) -> bool:
        """Whether `request`'s chunks on their way up from kvswap's secondary tiers (its
        lookup found them there and vLLM deferred it) were promoted now, within the
        step's budget: the request then looks its hit up again in this step, where vLLM
        would look again a step later, or several while the read runs."""
        manager = self.scheduler.manager
        if not isinstance(manager, KvswapTieringManager):
            return False
        num_chunks = manager.chunks_promoting(request.request_id)
        if not num_chunks:
            return False
        group = _group_config(self.scheduler)
        if not sync.reserve_bytes(num_chunks * group.tokens_per_chunk * sync.kv_bytes_per_token):
            return False
        start_s = time.monotonic()
        sync.counts.promoted_chunks += manager.promote_now(request.request_id)
        sync.counts.promotion_wait_ms += (time.monotonic() - start_s) * 1e3
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        sync = self._sync
        if sync is None or request.request_id not in sync.step_requests or not num_external_tokens:
            if sync is not None and num_external_tokens:
                sync.counts.between_steps += 1
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        scheduler = self.scheduler
        status = scheduler._req_status[request.request_id]
        first_fresh = ceil_div(status.num_locally_computed_tokens, _tokens_per_block(scheduler))
        being_loaded = scheduler._chunks_being_loaded
        loading_before = frozenset(being_loaded or ())
        jobs_before = set(scheduler._current_batch_load_jobs)
        super().update_state_after_alloc(
            request, _unhashed_from(blocks, first_fresh), num_external_tokens
        )
        created = set(scheduler._current_batch_load_jobs) - jobs_before
        if not created:  # nothing left to load: no job to wait for
            return
        (job_id,) = created
        job = scheduler._jobs.pop(job_id)
        status.transfer_jobs.discard(job_id)
        if being_loaded is not None:  # loaded before any later step looks them up
            being_loaded.difference_update(job.keys - loading_before)
        sync.taken[job_id] = _TakenJob(set(job.keys), status.req_context)
        sync.step_jobs.add(job_id)
        sync.counts.within_step += 1
        sync.counts.within_step_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        sync = self._sync
        if sync is None:
            return meta
        jobs = frozenset(sync.step_jobs)
        sync.end_step()
        return KvswapConnectorMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            sync_load_jobs=jobs,
        )

    def update_connector_output(self, connector_output: Any) -> None:
        sync = self._sync
        completed = getattr(connector_output.kv_connector_worker_meta, "completed_jobs", None)
        if sync is not None and completed:
            for job_id in [job_id for job_id in completed if job_id in sync.taken]:
                del completed[job_id]
                taken = sync.taken.pop(job_id)
                self.scheduler.manager.complete_load(taken.keys, taken.req_context)
        super().update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        if self._sync is not None:
            self._sync.taken.clear()  # their completions come as stale jobs, ignored
        reset: bool | None = super().reset_cache()
        return reset

    # --- the worker's side --------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        jobs: frozenset[int] = getattr(meta, "sync_load_jobs", frozenset())
        if jobs:
            worker = self.connector_worker
            assert worker is not None and worker.worker is not None
            worker.worker.wait(jobs)
            self._waited_requests |= {meta.load_jobs[job_id].req_id for job_id in jobs}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, receiving = super().get_finished(finished_req_ids)
        waited = receiving & self._waited_requests
        self._waited_requests -= waited
        return sending, receiving - waited


def _group_config(scheduler: Any) -> Any:
    (group,) = scheduler.config.kv_group_configs  # kvswap's adapter: one KV cache group
    return group


def _tokens_per_block(scheduler: Any) -> int:
    return int(_group_config(scheduler).tokens_per_block)


def _unhashed_from(blocks: Any, first_index: int) -> Any:
    """`blocks` with every block from `first_index` on shown without its hash: the
    blocks a synchronous load fills, which vLLM cached when it allocated them."""
    return KVCacheBlocks(
        tuple(
            [
                *group[:first_index],
                *(_UnhashedBlock(block.block_id, block.is_null) for block in group[first_index:]),
            ]
            for group in blocks.blocks
        )
    )


def _kv_bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes of one token on this worker, over every layer of every group, as
    vLLM 0.33's connector counts them against the budget."""
    return sum(
        _group_kv_bytes_per_block(group) // group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
    )
