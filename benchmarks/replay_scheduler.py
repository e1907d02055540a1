"""vLLM's scheduler, one step at a time, over the device pool and the connector: no model.

vLLM 0.32's `Scheduler.schedule` / `update_from_output` (v1/core/sched/scheduler.py)
for one full-attention group with prefix caching, FCFS, no speculative decoding,
and what of it decides where a prompt's KV comes from:

    1. running requests, in order: a decode token each (a prefill's remaining tokens
       if it was cut by the token budget); no block for one: the LAST running request
       is preempted (its blocks freed, back to the head of the waiting queue) until
       one is, or the request itself was the last
    2. only if nothing was preempted: waiting requests, those holding loaded KV first,
       while fewer than max_num_seqs run: a device prefix hit (never the whole prompt:
       the last token is always computed), then the connector's host-tier hit after
       it; admitted only if the whole prompt fits in the free blocks (vLLM's
       scheduler_reserve_full_isl), else admission stops for this step. With a host
       hit the request waits for its load (blocks allocated, nothing computed) and
       runs the step after it lands, whatever max_num_seqs says meanwhile
    3. the connector's end of step (stores of what this step computes, the finished
       requests let go), then the model "runs": every request whose prompt is
       computed samples its next planned token; a request with all its tokens
       finishes and frees its blocks (they stay cached)

Hit tokens are counted as vLLM's PrefillStats count them: the device and host
split of the admission that ran (a preempted request's later admissions are not).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvswap.units import ceil_div
from replay_connector import ReplayConnector
from replay_pool import DevicePool
from replay_request import ReplayRequest, Status


@dataclass(frozen=True)
class EngineShape:
    """The engine the replay stands for (vllm_policy_hits.py's SHAPE)."""

    block_tokens: int
    device_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class StepResult:
    scheduled_tokens: int
    finished: list[ReplayRequest] = field(default_factory=list)


class ReplayScheduler:
    """vLLM's scheduler over a `DevicePool` and a `ReplayConnector` (module docstring)."""

    def __init__(self, shape: EngineShape, connector: ReplayConnector) -> None:
        self.shape = shape
        self.connector = connector
        self.pool = DevicePool(shape.device_blocks)
        self.waiting: deque[ReplayRequest] = deque()
        self.holding: deque[ReplayRequest] = deque()  # waiting with KV (their loads)
        self.running: list[ReplayRequest] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._inflight: set[ReplayRequest] = set()  # loading, or prefilling past this step
        self._finished_last_step: list[ReplayRequest] = []

    def add(self, request: ReplayRequest) -> None:
        self.waiting.append(request)
        self.connector.on_new_request(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.holding or self.running)

    def step(self, tick: int) -> StepResult:
        """One engine step at `tick` (the driver's clock, recorded on admissions)."""
        self.num_steps += 1
        scheduled: dict[ReplayRequest, int] = {}
        preempted: list[ReplayRequest] = []
        budget = self._schedule_running(scheduled, preempted)
        new_ids: list[str] = []
        if not preempted:
            self._schedule_waiting(scheduled, new_ids, budget, tick)
        finished_last, self._finished_last_step = self._finished_last_step, []
        self.connector.end_schedule(
            scheduled, finished_last, new_ids, [r.context.req_id for r in preempted],
            self.num_steps,
        )  # fmt: skip
        for request, num_new_tokens in scheduled.items():
            request.num_computed_tokens += num_new_tokens
            if request.num_computed_tokens >= request.num_tokens:
                self._inflight.discard(request)
        result = StepResult(sum(scheduled.values()))
        for request in scheduled:
            if request.num_computed_tokens >= request.num_tokens and request.append_output():
                self._finish(request, tick)
                result.finished.append(request)
        for request in self.connector.land(self.num_steps):
            request.load_done = True
        return result

    # --- 1. running -------------------------------------------------------------------

    def _schedule_running(
        self, scheduled: dict[ReplayRequest, int], preempted: list[ReplayRequest]
    ) -> int:
        budget = self.shape.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.shape.max_model_len - request.num_computed_tokens - 1,
            )
            if num_new_tokens <= 0:
                index += 1
                continue
            while not self._allocate(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if preempted and preempted[-1] is request:
                break
            scheduled[request] = num_new_tokens
            budget -= num_new_tokens
            index += 1
        return budget

    def _preempt(self, request: ReplayRequest) -> None:
        self.pool.free(request.blocks)
        request.blocks = []
        request.num_committed_blocks = 0
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = Status.PREEMPTED
        self._inflight.discard(request)
        self.waiting.appendleft(request)
        self.connector.preempted(request)
        self.num_preemptions += 1

    # --- 2. waiting -------------------------------------------------------------------

    def _schedule_waiting(
        self, scheduled: dict[ReplayRequest, int], new_ids: list[str], budget: int, tick: int
    ) -> None:
        size = self.shape.block_tokens
        skipped_holding: list[ReplayRequest] = []
        skipped_waiting: list[ReplayRequest] = []

        def skip(queue: deque[ReplayRequest]) -> None:
            request = queue.popleft()
            holds_kv = request.num_computed_tokens > 0 or request.status is Status.LOADING
            (skipped_holding if holds_kv else skipped_waiting).append(request)

        while budget > 0:
            queue = self.holding if self.holding else self.waiting
            if not queue or len(self.running) >= self.shape.max_num_seqs:
                break
            request = queue[0]
            if request.status is Status.LOADING:
                if not request.load_done:
                    skip(queue)
                    continue
                self._commit(request, request.num_computed_tokens)  # the loaded blocks
                if request.num_computed_tokens == request.num_tokens:
                    request.num_computed_tokens -= 1  # the last token is computed to sample
                request.status = Status.PREEMPTED if request.num_preemptions else Status.WAITING
                request.load_done = False
            hit_blocks: list[int] = []
            local_tokens = external_tokens = 0
            if request.num_computed_tokens == 0:
                hit_blocks = self.pool.longest_hit(
                    request.block_hashes, (request.num_tokens - 1) // size
                )
                local_tokens = len(hit_blocks) * size
                matched = self.connector.matched_tokens(request, local_tokens)
                if matched is None:
                    skip(queue)
                    continue
                external_tokens = matched
                if request.num_preemptions == 0:
                    request.local_hit_tokens = local_tokens
                    request.external_hit_tokens = external_tokens
            loading = external_tokens > 0
            computed_tokens = request.num_computed_tokens + local_tokens + external_tokens
            num_new_tokens = 0 if loading else min(request.num_tokens - computed_tokens, budget)
            if not self._allocate(
                request, num_new_tokens, hit_blocks=hit_blocks, computed_tokens=computed_tokens,
                delay_commit=loading, must_fit=True,
                reserved_blocks=self._reserved_blocks() if loading else 0,
            ):  # fmt: skip
                break
            self.connector.after_alloc(request, external_tokens, self.num_steps)
            request.num_computed_tokens = computed_tokens
            if loading:
                request.status = Status.LOADING
                self._inflight.add(request)
                skip(queue)
                continue
            queue.popleft()
            self.running.append(request)
            scheduled[request] = num_new_tokens
            budget -= num_new_tokens
            if request.status is Status.WAITING:
                new_ids.append(request.context.req_id)
            request.status = Status.RUNNING
            if request.admitted_tick is None:
                request.admitted_tick = tick
            if computed_tokens + num_new_tokens < request.num_tokens:
                self._inflight.add(request)
        self.holding.extendleft(reversed(skipped_holding))
        self.waiting.extendleft(reversed(skipped_waiting))

    def _reserved_blocks(self) -> int:
        """Blocks the in-flight prefills still need (an async load may not take them)."""
        full = self.shape.max_model_len
        return sum(
            max(ceil_div(min(r.num_tokens, full), self.shape.block_tokens) - len(r.blocks), 0)
            for r in self._inflight
        )

    # --- blocks -----------------------------------------------------------------------

    def _allocate(
        self,
        request: ReplayRequest,
        num_new_tokens: int,
        *,
        hit_blocks: list[int] | None = None,
        computed_tokens: int | None = None,
        delay_commit: bool = False,
        must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> bool:
        """vLLM's allocate_slots: blocks for `computed_tokens` (default: the request's)
        plus `num_new_tokens`, taking the device hit's `hit_blocks`; False if they do not
        fit (nothing changes then)."""
        size, max_len = self.shape.block_tokens, self.shape.max_model_len
        hits = hit_blocks or []
        computed = request.num_computed_tokens if computed_tokens is None else computed_tokens
        held = len(request.blocks) + len(hits)
        evictable_hits = sum(self.pool.is_free(block) for block in hits)
        free = self.pool.num_free_blocks()
        if must_fit:
            full_blocks = ceil_div(min(request.num_tokens, max_len), size)
            if max(full_blocks - held, 0) + evictable_hits > free:
                return False
        slot_tokens = min(computed + num_new_tokens, max_len)
        num_blocks = max(ceil_div(slot_tokens, size) - held, 0)
        if num_blocks + evictable_hits > free - reserved_blocks:
            return False
        if hits:
            self.pool.touch(hits)
            request.blocks.extend(hits)
            request.num_committed_blocks = len(request.blocks)
        request.blocks.extend(self.pool.allocate(num_blocks))
        if not delay_commit:
            self._commit(request, min(computed + num_new_tokens, request.num_tokens))
        return True

    def _commit(self, request: ReplayRequest, num_tokens: int) -> None:
        """The request's full blocks up to `num_tokens` become findable by hash."""
        full = min(num_tokens // self.shape.block_tokens, len(request.blocks))
        for index in range(request.num_committed_blocks, full):
            self.pool.cache(request.blocks[index], request.block_hashes[index])
        request.num_committed_blocks = max(request.num_committed_blocks, full)

    # --- 3. output --------------------------------------------------------------------

    def _finish(self, request: ReplayRequest, tick: int) -> None:
        request.status = Status.FINISHED
        request.finish_tick = tick
        self.connector.update_keys(request)  # its last block's key (vLLM's request_finished)
        self.pool.free(request.blocks)
        request.blocks = []
        self.running.remove(request)
        self._inflight.discard(request)
        self._finished_last_step.append(request)
