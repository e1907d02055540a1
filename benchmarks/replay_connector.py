"""vLLM's offloading connector, scheduler side, driving the host-tier manager under test.

vLLM 0.32's `OffloadingConnectorScheduler`
(distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py) for one
full-attention group, one block per chunk, `offload_prompt_only = True` (its
default), no sliding window, no partial tails. The calls it makes on the manager,
and when:

    a request arrives          on_new_request
    its admission is tried     lookup, chunk by chunk after the device's prefix hit:
                               HITs count, the first MISS ends it; a HIT_PENDING (a
                               store in flight) or a chunk another load is bringing
                               defers the admission (`matched_tokens` answers None)
    admitted with a host hit   prepare_load of those chunks (the request waits for
                               them); its store index skips every hit chunk
    every step                 on_schedule_end, then for each request scheduled this
                               step and each that finished last step: prepare_store
                               of its computed PROMPT chunks not offered yet, device
                               hits included when it loaded nothing (those the tier
                               holds count as reused, the others are stored again);
                               None (no room) leaves the index, so the next step
                               offers them again; then on_request_finished for the
                               requests that finished last step
    a transfer lands           complete_load / complete_store

When transfers land is the replay's: both at the end of the step after the one that
prepared them. vLLM's worker submits a store at the start of that next step; a load
starts in its own step, and one step later is what the real run shows (calibrated
on vllm_policy_hits.py's chat: with loads landing in their own step the replay's 2x
kvswap row is 2.7 % off the real one; one step later the replay gives the real
run's hit tokens, loads and evictions exactly for kvswap at 4x and 2x and LRU at
2x). Where in the worker that step goes (its copy threads finishing after the
step's report, most likely) was not traced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext, make_offload_key

from kvswap.units import ceil_div
from replay_request import ReplayRequest

#: Steps from a transfer's preparation to its completion (module docstring).
LOAD_STEPS = 1
STORE_STEPS = 1


@dataclass
class ConnectorCounts:
    """What the connector asked of the host tier over a run, in chunks unless named."""

    load_jobs: int = 0
    blocks_loaded: int = 0
    store_jobs: int = 0
    blocks_stored: int = 0
    evictions: int = 0  # chunks prepare_store evicted
    refused_stores: int = 0  # prepare_store calls answered None (no victims found)
    deferred_lookups: int = 0  # admissions put off: a chunk pending or being loaded


@dataclass
class _Job:
    request: ReplayRequest
    keys: list[bytes]
    is_store: bool
    due_step: int


@dataclass
class ReplayConnector:
    """The connector's scheduler side over `manager` (module docstring)."""

    manager: Any
    block_tokens: int
    counts: ConnectorCounts = field(default_factory=ConnectorCounts)
    #: Each key the tier took: the workload request that first stored it, its end token.
    first_stored_by: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    _jobs: dict[int, _Job] = field(default_factory=dict)
    _next_job_id: int = 0
    _being_loaded: set[bytes] = field(default_factory=set)

    def on_new_request(self, request: ReplayRequest) -> None:
        self.manager.on_new_request(request.context)

    def matched_tokens(self, request: ReplayRequest, local_tokens: int) -> int | None:
        """Tokens the host tier can add after a device hit of `local_tokens` (block
        aligned); None: ask again later (vLLM's get_num_new_matched_tokens)."""
        request.connector_blocks = 0
        if request.jobs:
            return None  # its own transfers are still in flight
        self.update_keys(request)
        request.lookup_local_tokens = local_tokens
        size = self.block_tokens
        max_hit_tokens = min(request.num_tokens, len(request.offload_keys) * size)
        if max_hit_tokens - local_tokens < size:
            return 0
        start = local_tokens // size
        end = min(ceil_div(max_hit_tokens, size), len(request.offload_keys))
        hits, pending = 0, False
        for key in request.offload_keys[start:end]:
            result = self.manager.lookup(key, request.context)
            if result is LookupResult.MISS:
                break
            pending |= result is not LookupResult.HIT  # HIT_PENDING (or RETRY)
            hits += result is not LookupResult.RETRY
        if pending:
            self.counts.deferred_lookups += 1
            return None
        if hits == 0:
            return 0
        hit_tokens = min(max_hit_tokens, size * (start + hits)) - local_tokens
        if hit_tokens < size:
            return 0
        keys = request.offload_keys[start : ceil_div(local_tokens + hit_tokens, size)]
        if not self._being_loaded.isdisjoint(keys):
            self.counts.deferred_lookups += 1
            return None
        return hit_tokens

    def after_alloc(self, request: ReplayRequest, external_tokens: int, step: int) -> None:
        """The request was admitted with `external_tokens` from the host tier: load them."""
        if external_tokens == 0:
            return
        size = self.block_tokens
        end = ceil_div(request.lookup_local_tokens + external_tokens, size)
        keys = request.offload_keys[request.lookup_local_tokens // size : end]
        self.manager.prepare_load(keys, request.context)
        self._add_job(_Job(request, keys, is_store=False, due_step=step + LOAD_STEPS))
        request.next_stored_chunk = end  # chunk-level offload: the hit is not stored again
        self._being_loaded.update(keys)
        self.counts.load_jobs += 1
        self.counts.blocks_loaded += len(keys)

    def end_schedule(
        self,
        scheduled: Mapping[ReplayRequest, int],
        finished: Sequence[ReplayRequest],
        new_request_ids: Sequence[str],
        preempted_request_ids: Sequence[str],
        step: int,
    ) -> None:
        """vLLM's build_connector_meta: the step's end for the manager, the stores of
        what this step computes, and the finished requests let go."""
        for request in scheduled:
            self.update_keys(request)
            request.connector_blocks = len(request.blocks)
        self.manager.on_schedule_end(
            ScheduleEndContext(new_req_ids=new_request_ids, preempted_req_ids=preempted_request_ids)
        )
        for request, num_new_tokens in scheduled.items():
            self._store(request, request.num_computed_tokens + num_new_tokens, step)
        for request in finished:
            self._store(request, max(request.num_prompt_tokens, request.num_tokens - 1), step)
        for request in finished:
            self.manager.on_request_finished(request.context)

    def preempted(self, request: ReplayRequest) -> None:
        request.connector_blocks = 0

    def land(self, step: int) -> list[ReplayRequest]:
        """Complete the transfers due by the end of `step`; the requests whose load landed."""
        loaded = []
        for job_id in [j for j, job in self._jobs.items() if job.due_step <= step]:
            job = self._jobs.pop(job_id)
            job.request.jobs.discard(job_id)
            if job.is_store:
                self.manager.complete_store(job.keys, job.request.context)
                continue
            self.manager.complete_load(job.keys, job.request.context)
            self._being_loaded.difference_update(job.keys)
            loaded.append(job.request)
        return loaded

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def update_keys(self, request: ReplayRequest) -> None:
        """An offload key for each full block the request has (vLLM's update_offload_keys),
        with its end position recorded in the request's context."""
        size = self.block_tokens
        for index in range(len(request.offload_keys), len(request.block_hashes)):
            key = make_offload_key(request.block_hashes[index], 0)
            request.offload_keys.append(key)
            request.context.set_offload_key_position(key, (index + 1) * size)

    def _store(self, request: ReplayRequest, num_tokens_after_step: int, step: int) -> None:
        offloadable = min(num_tokens_after_step, request.num_tokens, request.num_prompt_tokens)
        storable = min(
            offloadable // self.block_tokens, request.connector_blocks, len(request.offload_keys)
        )
        keys = request.offload_keys[request.next_stored_chunk : storable]
        if not keys:
            request.next_stored_chunk = max(request.next_stored_chunk, storable)
            return
        output = self.manager.prepare_store(keys, request.context)
        if output is None:
            self.counts.refused_stores += 1  # offered again next step (the index stays)
            return
        self.counts.evictions += len(output.evicted_keys)
        request.next_stored_chunk = max(request.next_stored_chunk, storable)
        if not output.keys_to_store:
            return
        for key in output.keys_to_store:
            position = request.context.get_offload_key_position(key)
            self.first_stored_by.setdefault(key, (request.request_id, position))
        stored = list(output.keys_to_store)
        self._add_job(_Job(request, stored, is_store=True, due_step=step + STORE_STEPS))
        self.counts.store_jobs += 1
        self.counts.blocks_stored += len(stored)

    def _add_job(self, job: _Job) -> None:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = job
        job.request.jobs.add(job_id)
