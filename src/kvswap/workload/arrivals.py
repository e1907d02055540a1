"""Requests of a workload entering a scheduler at their arrival times.

Shared by the engine (wall clock) and the simulator (virtual clock). A later
turn of a conversation is queued only when the turn it follows finishes, at
that finish time + its think time, with its prompt resolved from the
previous prompt and output. A rejected request's follow-ups are queued at
once (they are then usually rejected too, with their own reason).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Protocol

from kvswap.sampling import SamplingParams, workload_request_seed
from kvswap.workload.request import Workload, resolve_prompt


class IdleClock(Protocol):
    def idle_until(self, t_s: float) -> None: ...


class Answer(Protocol):
    @property
    def accepted(self) -> bool: ...


class Admits(Protocol):
    """Where requests enter: a scheduler (`kvswap.control.scheduler.Scheduler`)."""

    def add_request(
        self,
        seq_id: int,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        arrival_s: float,
        *,
        cache_salt: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Answer: ...


class ArrivalQueue:
    """`sampling`: what every request of the workload samples with (None: greedy),
    handed to the scheduler with each request, each with its own seed derived from
    `sampling.seed` and its id (two requests with one prompt still draw apart)."""

    def __init__(self, workload: Workload, sampling: SamplingParams | None = None):
        self.workload = workload
        self.sampling = sampling
        self._heap = [(r.arrival_s, r.request_id) for r in workload.first_arrivals()]
        heapq.heapify(self._heap)
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.outputs: dict[int, tuple[int, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self._heap)

    def next_arrival_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def idle(self, backend: IdleClock, now_s: float) -> None:
        """Nothing runs: idle until the next arrival (a follow-up may be queued later)."""
        next_s = self.next_arrival_s()
        if next_s is not None:
            backend.idle_until(next_s)

    def admit_due(self, scheduler: Admits, now_s: float) -> None:
        """Hand every request arrived by `now_s` to the scheduler."""
        while self._heap and self._heap[0][0] <= now_s:
            arrival_s, request_id = heapq.heappop(self._heap)
            request = self.workload[request_id]
            prompt = tuple(resolve_prompt(request, self.outputs, self.prompts))
            self.prompts[request_id] = prompt
            admission = scheduler.add_request(
                request_id, prompt, request.max_new_tokens, arrival_s,
                cache_salt=request.cache_salt, sampling=self._sampling_of(request_id),
            )  # fmt: skip
            if not admission.accepted:
                self.finished(request_id, (), now_s, think=False)

    def _sampling_of(self, request_id: int) -> SamplingParams | None:
        if self.sampling is None:
            return None
        seed = workload_request_seed(self.sampling.seed, request_id)
        return dataclasses.replace(self.sampling, seed=seed)

    def finished(
        self, request_id: int, output_ids: Sequence[int], done_s: float, *, think: bool = True
    ) -> None:
        """Record a request's output and queue the turns that follow it."""
        self.outputs[request_id] = tuple(output_ids)
        for follow_up in self.workload.follow_ups_of(request_id):
            assert follow_up.follow_up is not None
            delay_s = follow_up.follow_up.think_time_s if think else 0.0
            heapq.heappush(self._heap, (done_s + delay_s, follow_up.request_id))
