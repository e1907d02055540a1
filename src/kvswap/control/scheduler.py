"""Continuous batching over the tiered store: admit, preempt, resume, finish.

Torch-free and clock-agnostic: the engine drives it with a model and a wall
clock, the simulator with a cost model and a virtual clock. One step:

    plan = scheduler.schedule(now_s)    admit / resume / preempt; slots allocated;
                                        swap-ins started and waited for
    ... runner computes plan.seqs, samples one token per sampling sequence ...
    scheduler.complete(plan, sampled, now_s, failed=...)
                                        outputs appended, finished sequences
                                        offloaded (a failed sampling aborts only
                                        its own), swap-out past the watermark started

Every running sequence has all its blocks on the GPU during the step (paged
attention reads them all). When the GPU cannot grow the batch, the newest
running sequence is preempted: by swapping its blocks out (default) or by
dropping them to be recomputed (vLLM V1's only mode, kept for comparison).
Preempted sequences resume first, their blocks prefetched on the HIGH queue.

The scheduler is the one owner of requests: `add_request` records a run (its
sampling included: each `ScheduledSeq` carries it to the backend) and answers
with an `Admission`; `forget` drops a finished run. Nobody else writes `runs`.
The records themselves are in `control/scheduler_records.py`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from kvswap.base.identity import check_cache_salt
from kvswap.control.request_fault import RequestFailed, blame, failure_reason
from kvswap.control.scheduler_records import (
    ACCEPTED,
    Admission,
    FinishReason,
    Preemption,
    Refusal,
    RefusalReason,
    ScheduledSeq,
    SchedulerSettings,
    SequenceRun,
    StepPlan,
)
from kvswap.control.swapper import Swapper
from kvswap.sampling import LogitsContext, LogitsOptions, SamplingParams
from kvswap.units import ceil_div


class Scheduler:
    def __init__(self, swapper: Swapper, settings: SchedulerSettings):
        self.swapper = swapper
        self.settings = settings
        self.block_tokens = swapper.block_tokens
        self.runs: dict[int, SequenceRun] = {}
        self.waiting: deque[int] = deque()
        self.preempted: deque[int] = deque()
        self.running: list[int] = []
        self.finished: list[int] = []
        self.step = 0
        self.num_preemptions = 0
        self.tokens_generated = 0
        self.recomputed_tokens = 0
        self._aborted: list[int] = []  # by the step being planned (`_contain`)

    # ----------------------------------------------------------------- intake

    def add_request(
        self,
        seq_id: int,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        arrival_s: float,
        *,
        cache_salt: str | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        sampling: SamplingParams | None = None,
        options: LogitsOptions | None = None,
    ) -> Admission:
        """Queue a request with its sampling (None: greedy) and logits options (None:
        none); every step that samples it carries both to the backend. One that can
        never run (see `admission`), or whose admission fails, is refused: recorded as
        finished (ABORT) with its refusal; the others keep running."""
        run = SequenceRun(
            seq_id, tuple(prompt_ids), max_new_tokens, arrival_s, cache_salt, sampling,
            options, stop_token_ids=stop_token_ids,
        )  # fmt: skip
        self.runs[seq_id] = run
        try:
            check_cache_salt(cache_salt)
            admission = self.admission(len(prompt_ids), max_new_tokens)
        except Exception as error:  # whatever fails admitting one request refuses it
            admission = Admission(Refusal(RefusalReason.INVALID, failure_reason(error)))
        run.refusal = admission.refusal
        if admission.accepted:
            self.waiting.append(seq_id)
        else:
            run.finish_s = arrival_s
            run.finish_reason = FinishReason.ABORT
            self.finished.append(seq_id)
        return admission

    def max_request_tokens(self) -> int:
        """THE longest prompt + output a request may have: within the model's maximum
        position, and a sequence must fit the GPU tier (a running sequence has every
        block there) beside the protected sink blocks. Reads only what is fixed at
        construction, so a server may ask from another thread."""
        gpu_tokens = max(0, self._usable_gpu_blocks()) * self.block_tokens
        max_positions = self.settings.max_sequence_tokens
        return gpu_tokens if max_positions is None else min(max_positions, gpu_tokens)

    def admission(self, num_prompt_tokens: int, max_new_tokens: int) -> Admission:
        """What `add_request` answers for a request of this size: a refusal iff it can
        never run (an empty prompt, or more than `max_request_tokens`). Thread-safe
        like `max_request_tokens`, so a server refuses before queueing."""
        num_tokens = num_prompt_tokens + max_new_tokens
        if num_prompt_tokens == 0:
            return Admission(Refusal(RefusalReason.EMPTY_PROMPT, "empty prompt"))
        if num_tokens <= self.max_request_tokens():
            return ACCEPTED
        max_positions = self.settings.max_sequence_tokens
        if max_positions is not None and num_tokens > max_positions:
            # Checked here, not in the forward pass, so one such request cannot end a run.
            return Admission(Refusal(
                RefusalReason.PAST_MAX_POSITION,
                f"needs {num_tokens} tokens ({num_prompt_tokens} prompt + {max_new_tokens} new) "
                f"but the model's maximum position is {max_positions} tokens",
            ))  # fmt: skip
        return Admission(Refusal(
            RefusalReason.EXCEEDS_GPU_TIER,
            f"needs {ceil_div(num_tokens, self.block_tokens)} blocks of {self.block_tokens} "
            f"tokens but a running sequence must fit the GPU tier "
            f"({self._usable_gpu_blocks()} usable blocks)",
        ))  # fmt: skip

    def _usable_gpu_blocks(self) -> int:
        return self.swapper.num_gpu_blocks - self.swapper.protected_blocks

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's run (a server runs for days and keeps no history).
        Its KV is the swapper's, as for any finished request."""
        run = self.runs[seq_id]
        if run.finish_s is None:
            raise ValueError(f"request {seq_id} has not finished; end it before forgetting it")
        del self.runs[seq_id]

    def end_request(self, seq_id: int, now_s: float, *, discard: bool) -> bool:
        """End a request before it finishes by itself, between steps: `discard` False
        (its client matched a stop string): finished as STOP, its KV kept and
        offloaded as a finished request's; True (its client left): ABORT, its KV
        freed on every tier. Returns False if it had already finished."""
        run = self.runs[seq_id]
        if run.finish_s is not None:
            return False
        if seq_id in self.waiting:
            self.waiting.remove(seq_id)  # never admitted: it holds no KV
        else:
            if seq_id in self.running:
                self.running.remove(seq_id)
            elif seq_id in self.preempted:
                self.preempted.remove(seq_id)
            if not self.swapper.holds_kv(seq_id):
                pass  # preempted for recompute: nothing held
            elif discard:
                self.swapper.discard(seq_id)
            else:
                self.swapper.finish(seq_id)
        run.finish_s = now_s
        run.finish_reason = FinishReason.ABORT if discard else FinishReason.STOP
        self.finished.append(seq_id)
        return True

    def abort(self, seq_id: int, now_s: float, reason: str) -> bool:
        """End a request whose serving failed (`RequestFailed`): ABORT with `reason`, its
        KV freed on every tier; the others go on. Returns False if it had finished."""
        if not self.end_request(seq_id, now_s, discard=True):
            return False
        self.runs[seq_id].abort_reason = reason
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.running)

    # --------------------------------------------------------------- schedule

    def schedule(self, now_s: float) -> StepPlan:
        self.step += 1
        self.swapper.begin_step(self.step)
        wait_s = 0.0
        seqs: list[ScheduledSeq] = []
        # Each fallback drops one paused sequence's KV, so this ends.
        for _ in range(self.swapper.num_open_sequences + 1):
            self._repair_lost(now_s)
            self._resume_preempted(now_s)
            self._admit(now_s)
            # Bring every running sequence's blocks up before growing any: running
            # blocks are never eviction candidates, so allocation cannot undo this.
            waited = self.swapper.wait_ready(self.running)
            for seq_id in reversed(waited.not_ready):
                self.running.remove(seq_id)
                self.swapper.set_running(seq_id, False)
                self.preempted.appendleft(seq_id)
            wait_s += waited.wait_s
            self._repair_lost(now_s)  # a failed NVMe read surfaces during the wait
            seqs = self._allocate_running(now_s)
            if seqs or self.swapper.has_transfers_in_flight or not self._fall_back_to_recompute():
                break
        aborted, self._aborted = tuple(self._aborted), []
        return StepPlan(self.step, tuple(seqs), wait_s, aborted)

    def complete(
        self,
        plan: StepPlan,
        sampled: Mapping[int, int],
        now_s: float,
        *,
        failed: Mapping[int, str] | None = None,
    ) -> list[int]:
        """Apply a step's sampled tokens; returns the sequences that finished.

        `failed`: sequences whose sampling failed this step (seq id -> why). Each ends
        alone, as ABORT with its `abort_reason`, its KV freed on every tier; the
        others go on."""
        done: list[int] = []
        aborted: list[int] = []
        for item in plan.seqs:
            run = self.runs[item.seq_id]
            if failed and item.seq_id in failed:
                run.finish_reason = FinishReason.ABORT
                run.abort_reason = failed[item.seq_id]
                aborted.append(item.seq_id)
                continue
            if not item.samples:
                continue
            run.output_ids.append(sampled[item.seq_id])
            run.token_times_s.append(now_s)
            self.tokens_generated += 1
            if run.first_token_s is None:
                run.first_token_s = now_s
            if run.output_ids[-1] in run.stop_token_ids:
                run.finish_reason = FinishReason.STOP
                done.append(item.seq_id)
            elif len(run.output_ids) >= run.max_new_tokens:
                run.finish_reason = FinishReason.LENGTH
                done.append(item.seq_id)
        for seq_id in done:
            self.running.remove(seq_id)
            try:
                with blame(seq_id):
                    self.swapper.finish(seq_id)
            except RequestFailed as failure:  # its offload failed: it ends alone, ABORT
                self.runs[seq_id].finish_reason = FinishReason.ABORT
                self.runs[seq_id].abort_reason = failure.reason
                aborted.append(seq_id)
                done.remove(seq_id)
        for seq_id in aborted:
            if seq_id in self.running:
                self.running.remove(seq_id)
            if self.swapper.holds_kv(seq_id):
                self.swapper.discard(seq_id)
        done += aborted
        for seq_id in done:
            self.runs[seq_id].finish_s = now_s
            self.finished.append(seq_id)
        self.swapper.end_step()
        self._prefetch_next_resume()
        return done

    def _prefetch_next_resume(self) -> None:
        """Bring the next preempted sequence's blocks up ahead of its resume, but only
        into free slots it will be allowed to keep (inside its residency window a
        prefetched block is one nobody can evict)."""
        if not self.preempted or not self.swapper.holds_kv(self.preempted[0]):
            return
        seq_id = self.preempted[0]
        if self.swapper.may_prefetch(seq_id):
            self.swapper.prefetch([seq_id])

    # ---------------------------------------------------------------- internal

    def _fits(self, num_blocks: int) -> bool:
        return self.swapper.may_join_running(num_blocks, batch_is_empty=not self.running)

    def _admit(self, now_s: float) -> None:
        # Each waiting request is checked on its own: requests admitted together in
        # one step do not count each other's blocks (allocated after admission), so
        # a burst may overshoot the ceiling; preemption then makes room. Counting them
        # made admission stricter and cost 4 % throughput on the seed's chat workload.
        while self.waiting and len(self.running) < self.settings.max_num_seqs:
            seq_id = self.waiting[0]
            run = self.runs[seq_id]
            if run.arrival_s > now_s or self.preempted:
                return
            ids = run.all_ids
            # Its prompt's blocks plus a block to grow into. Alone on the GPU it needs
            # only its exact bill (the next token may still fit the prompt's last
            # block), the one `add_request` accepted: asking for more could leave a
            # request that fits waiting forever on an empty GPU.
            if self.running:
                needed = ceil_div(len(ids), self.block_tokens) + 1
            else:
                needed = ceil_div(len(ids) + 1, self.block_tokens)
            if not self._fits(needed):
                return
            self.waiting.popleft()
            if run.admitted_s is None:
                run.admitted_s = now_s
            try:
                with blame(seq_id):
                    hit_tokens = self.swapper.open_sequence(seq_id, ids, cache_salt=run.cache_salt)
                    run.prefix_hit_tokens += hit_tokens
                    self._count_recompute(run, max(0, run.tokens_to_recompute - hit_tokens))
                    run.tokens_to_recompute = 0
                    self.swapper.set_running(seq_id, True)
                    self.running.append(seq_id)
                    self.swapper.prefetch([seq_id])
            except RequestFailed as failure:
                self._contain(failure, now_s)

    def _resume_preempted(self, now_s: float) -> None:
        while self.preempted and len(self.running) < self.settings.max_num_seqs:
            seq_id = self.preempted[0]
            if not self.swapper.holds_kv(seq_id):  # recompute mode: start over
                self.preempted.popleft()
                self.waiting.appendleft(seq_id)
                return
            if not self._fits(self.swapper.num_missing_gpu_blocks(seq_id) + 1):
                return
            self.preempted.popleft()
            try:
                with blame(seq_id):
                    self.swapper.set_running(seq_id, True)
                    self.running.append(seq_id)
                    self.swapper.prefetch([seq_id])
            except RequestFailed as failure:
                self._contain(failure, now_s)

    def _allocate_running(self, now_s: float) -> list[ScheduledSeq]:
        budget = self.settings.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for seq_id in list(self.running):
            if seq_id not in self.running:
                continue  # preempted below to make room for an older sequence
            run = self.runs[seq_id]
            num_tokens = run.num_tokens
            done = self.swapper.num_tokens_held(seq_id)
            count = min(num_tokens - done, max(1, budget))
            chunk = run.token_slice(done, done + count)
            try:
                with blame(seq_id):
                    while not self.swapper.allocate(seq_id, chunk):
                        victim = self.running[-1]
                        self._preempt(victim)
                        if victim == seq_id:
                            break
            except RequestFailed as failure:  # this one's or its victim's: it waits a step
                self._contain(failure, now_s)
                continue
            if seq_id not in self.running:
                continue
            budget -= len(chunk)
            samples = done + count == num_tokens
            context = None
            if samples and run.options is not None:
                context = LogitsContext(
                    run.options, run.prompt_ids, tuple(run.output_ids), run.stop_token_ids
                )
            seqs.append(ScheduledSeq(seq_id, tuple(chunk), done, samples, run.sampling, context))
            if budget <= 0:
                break
        # A victim is always the newest running sequence, at or after the one being
        # allocated, so no sequence already in `seqs` is ever preempted.
        return seqs

    def _preempt(self, seq_id: int) -> None:
        run = self.runs[seq_id]
        run.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq_id)
        self.preempted.append(seq_id)
        with blame(seq_id):
            if self.settings.preemption is Preemption.SWAP:
                self.swapper.swap_out_sequence(seq_id)
            else:
                run.tokens_to_recompute = self.swapper.num_tokens_held(seq_id)
                self.swapper.release(seq_id)

    def _fall_back_to_recompute(self) -> bool:
        """Nothing could run and nothing is moving: paused sequences hold GPU blocks
        that have nowhere to go (the tiers below are full or failing). Drop the
        newest paused sequence's KV; it is recomputed later, bit-identically.
        Returns False when there is nothing left to drop."""
        for seq_id in reversed(self.preempted):
            if self.swapper.holds_kv(seq_id):
                run = self.runs[seq_id]
                run.tokens_to_recompute = self.swapper.num_tokens_held(seq_id)
                self.swapper.release(seq_id, reason="fallback_recompute")
                return True
        return False

    def _contain(self, failure: RequestFailed, now_s: float) -> None:
        """The failure rule (`control.request_fault`): the request whose serving failed
        ends alone, reported with the plan being made; the pass goes on without it."""
        if self.abort(failure.seq_id, now_s, failure.reason):
            self._aborted.append(failure.seq_id)

    def _count_recompute(self, run: SequenceRun, num_tokens: int) -> None:
        run.recomputed_tokens += num_tokens
        self.recomputed_tokens += num_tokens

    def _repair_lost(self, now_s: float) -> None:
        """Blocks whose every copy failed are recomputed from the first lost one."""
        if not self.swapper.has_lost_blocks():
            return  # the usual case: no table to scan
        for seq_id in [*self.running, *self.preempted]:
            if not self.swapper.holds_kv(seq_id):
                continue
            first_lost = self.swapper.first_lost_token(seq_id)
            if first_lost is not None:
                run = self.runs[seq_id]
                self._count_recompute(run, self.swapper.num_tokens_held(seq_id) - first_lost)
                try:
                    with blame(seq_id):
                        self.swapper.truncate(seq_id, first_lost)
                except RequestFailed as failure:
                    self._contain(failure, now_s)
