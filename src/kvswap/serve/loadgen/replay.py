"""Send a workload's requests at their arrival times, on one asyncio loop.

    dispatcher (this loop)                        one task per request sent
    ----------------------                        ---------------------------
    pop every request due -> create_task --------> wait for a slot (--max-concurrency)
    sleep until: next due | deadline | a change     POST, read the stream, record it
    <------------------------- finished: queue its follow-ups at now + think time
    deadline or stop signal: stop sending, cancel in-flight tasks, wait for them

Open loop: first turns and trace rows are sent at their arrival times however
slow the server is (a slot wait delays only the send, and the send time is what
TTFT is measured from). A later turn of a conversation is due its think time
after the turn before it completed, with that turn's reply in its messages.

Bounds: at most `max_requests` are sent; at `duration_s` after the start the
run stops: requests in flight are cancelled and counted as such. A stop signal
(SIGINT, SIGTERM, SIGHUP, SIGQUIT) does the same, so what was measured so far
is kept; the caller re-raises it after printing.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import signal
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from kvswap.obs.loadgen_findings import TIMEOUT
from kvswap.serve.loadgen.client import OpenAIClient
from kvswap.serve.loadgen.prompts import Endpoint, PromptBook
from kvswap.serve.loadgen.results import Outcome, RequestRecord
from kvswap.signals import STOP_SIGNALS, signal_name
from kvswap.workload.request import Workload

#: (requests finished, requests planned, detail)
ReplayProgress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ReplaySettings:
    model: str
    endpoint: Endpoint
    max_requests: int | None = None
    duration_s: float | None = None
    max_concurrency: int | None = None
    timeout_s: float = 600.0


@dataclass(frozen=True)
class ReplayOutcome:
    records: tuple[RequestRecord, ...]  # the sent and the earliest unsent, by request id
    duration_s: float
    stopped_by: str | None  # None: ran to the end; "duration"; a signal name
    stop_signal: int | None  # the signal that stopped the run, to re-raise after printing


class Replay:
    """One run of `workload` against `client` (construct, then `await run()` once)."""

    def __init__(
        self,
        workload: Workload,
        prompts: PromptBook,
        client: OpenAIClient,
        settings: ReplaySettings,
        progress: ReplayProgress | None = None,
    ):
        self.workload = workload
        self.prompts = prompts
        self.client = client
        self.settings = settings
        self.progress = progress
        count = len(workload)
        self.num_planned = (
            count if settings.max_requests is None else min(count, settings.max_requests)
        )
        self.records: dict[int, RequestRecord] = {}
        self._due: list[tuple[float, int]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._num_sent = self._num_finished = 0
        self._start_s = 0.0
        self._changed = asyncio.Event()
        self._stop_signal: int | None = None
        self._slots = (
            asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
        )

    def now_s(self) -> float:
        return time.perf_counter() - self._start_s

    def request_stop(self, signum: int) -> None:
        """Stop sending and cancel what is in flight (a signal handler calls this)."""
        if self._stop_signal is None:
            self._stop_signal = signum
        self._changed.set()

    async def run(self) -> ReplayOutcome:
        self._start_s = time.perf_counter()
        for request in self.workload.first_arrivals():
            self._queue(request.request_id, request.arrival_s)
        deadline_s = self.settings.duration_s if self.settings.duration_s is not None else math.inf
        stopped_by: str | None = None
        with self._stop_signals_stop_the_run():
            while True:
                if self._stop_signal is not None:
                    stopped_by = signal_name(self._stop_signal)
                    break
                now_s = self.now_s()
                if now_s >= deadline_s:
                    stopped_by = "duration"
                    break
                while self._due and self._due[0][0] <= now_s and self._num_sent < self.num_planned:
                    due_s, request_id = heapq.heappop(self._due)
                    self._send(request_id, due_s)
                can_send = bool(self._due) and self._num_sent < self.num_planned
                if not can_send and not self._tasks:
                    break  # everything sent has finished and nothing more will come
                wake_s = min(self._due[0][0] if can_send else math.inf, deadline_s)
                await self._wait(wake_s - self.now_s())
            await self._cancel_in_flight()
        duration_s = min(self.now_s(), deadline_s)
        return ReplayOutcome(self._planned_records(), duration_s, stopped_by, self._stop_signal)

    def _planned_records(self) -> tuple[RequestRecord, ...]:
        """Every request sent, then the earliest unsent ones up to `num_planned`."""
        unsent = (r for r in self.workload if r.request_id not in self.records)
        pending = {
            r.request_id: RequestRecord(
                r.request_id, r.session_id, r.turn, r.max_new_tokens, r.arrival_s
            )
            for _, r in zip(range(self.num_planned - len(self.records)), unsent, strict=False)
        }
        return tuple(record for _, record in sorted({**self.records, **pending}.items()))

    def _queue(self, request_id: int, due_s: float) -> None:
        heapq.heappush(self._due, (due_s, request_id))

    def _send(self, request_id: int, due_s: float) -> None:
        request = self.workload[request_id]
        record = RequestRecord(
            request_id, request.session_id, request.turn, request.max_new_tokens, due_s
        )
        self.records[request_id] = record
        self._num_sent += 1
        task = asyncio.create_task(self._serve(record))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._num_finished += 1
        self._changed.set()
        if self.progress is not None:
            self.progress(self._num_finished, self.num_planned, f"{len(self._tasks)} in flight")

    async def _serve(self, record: RequestRecord) -> None:
        prompt = self.prompts.input_for(record.request_id)
        record.intended_prompt_tokens = prompt.intended_prompt_tokens
        body: dict[str, object] = {
            "model": self.settings.model,
            **prompt.fields,
            "max_tokens": record.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        try:
            if self._slots is None:
                await self._post(record, body)
            else:
                async with self._slots:
                    await self._post(record, body)
        except asyncio.CancelledError:
            record.outcome = Outcome.CANCELLED if record.sent_s is not None else Outcome.PENDING
            record.done_s = None
            raise
        finally:
            if record.outcome is not Outcome.COMPLETED:
                self.prompts.forget(record.request_id)

    async def _post(self, record: RequestRecord, body: dict[str, object]) -> None:
        record.sent_s = self.now_s()
        timeout_s = self.settings.timeout_s
        try:
            result = await asyncio.wait_for(
                self.client.stream(self.settings.endpoint, body), timeout_s
            )
        except asyncio.TimeoutError:
            record.done_s = self.now_s()
            record.outcome = Outcome.FAILED
            record.error = f"timeout: no complete answer within --timeout-s {timeout_s:g}"
            record.error_kind = TIMEOUT
            return
        record.done_s = self.now_s()
        record.http_status = result.status
        record.chunk_times_s = array("d", [t - self._start_s for t in result.chunk_times_s])
        record.prompt_tokens = result.prompt_tokens
        record.cached_tokens = result.cached_tokens
        if result.error is not None:
            record.outcome = Outcome.FAILED
            record.error, record.error_kind = result.error, result.error_kind
            return
        record.outcome = Outcome.COMPLETED
        completion_tokens = result.completion_tokens
        record.output_tokens = (
            completion_tokens if completion_tokens is not None else len(result.chunk_times_s)
        )
        self.prompts.record_reply(record.request_id, result.text, record.output_tokens)
        for follow_up in self.workload.follow_ups_of(record.request_id):
            assert follow_up.follow_up is not None
            self._queue(follow_up.request_id, record.done_s + follow_up.follow_up.think_time_s)

    async def _wait(self, timeout_s: float) -> None:
        """Until something changed (a request finished, a stop) or `timeout_s` passed."""
        if timeout_s > 0:
            with suppress(asyncio.TimeoutError):
                wait_s = None if math.isinf(timeout_s) else timeout_s
                await asyncio.wait_for(self._changed.wait(), wait_s)
        self._changed.clear()

    async def _cancel_in_flight(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @contextmanager
    def _stop_signals_stop_the_run(self) -> Iterator[None]:
        """While the loop runs, a stop signal ends the run cleanly instead of raising
        into whichever coroutine happens to run; the previous handlers come back after.
        Only the main thread can handle signals; elsewhere nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        try:
            for signum in STOP_SIGNALS:
                loop.add_signal_handler(signum, self.request_stop, int(signum))
            yield
        finally:
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                if handler is not None:
                    signal.signal(signum, handler)
