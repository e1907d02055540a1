"""The engine behind `kvswap serve`: one thread runs THE driver loop over live arrivals.

    HTTP event loop                       engine thread
    ---------------                       -------------
    submit() --> inbox (thread-safe) ---> LiveArrivals.admit_due: add_request / end_request
    handle.events() <-- call_soon_threadsafe -- listener: a TokenEvent per sampled token,
                                                Finished when the request ends

Continuous batching comes from the scheduler as in `kvswap run`: every request
the inbox holds joins the next step. The HTTP side only enqueues and reads its
asyncio queue; it never waits on compute. A request is ended between steps on
the client's word: a stop string (`stop_early`: finished, KV kept for prefix
reuse) or a disconnect (`cancel`: its KV freed on every tier).

`close(timeout_s)`: stop accepting, let in-flight requests finish until the
deadline, abort the rest, stop the loop, release the pools (the NVMe slab is
removed). If the engine thread dies, every open request ends with its error
and `healthy()` turns False.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, Counter

from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import FinishReason as SchedulerFinish
from kvswap.control.scheduler_records import StepPlan
from kvswap.drive.backend import Backend, StepOutput
from kvswap.drive.loop import Driver
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineSettings
from kvswap.errors import KvSwapError
from kvswap.obs.prometheus import PrometheusExporter
from kvswap.obs.watermarks import Watermarks
from kvswap.sampling import SamplingParams, sampling_or_greedy
from kvswap.serve.server_log import RequestLine, StatsLine, access_log, log
from kvswap.serve.service import (
    EngineService,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    ServiceStopping,
    TokenEvent,
)

#: The longest the idle engine thread sleeps before looking at its inbox again.
IDLE_WAIT_S = 0.05
#: Retry-After for a full queue: about one step of a loaded engine, rounded up.
RETRY_AFTER_S = 1.0
DEFAULT_MAX_WAITING_REQUESTS = 256

_FINISH_REASONS = {
    SchedulerFinish.STOP: FinishReason.STOP,
    SchedulerFinish.LENGTH: FinishReason.LENGTH,
    SchedulerFinish.ABORT: FinishReason.ABORT,
}


class LiveHandle(RequestHandle):
    """One request's event stream, fed from the engine thread."""

    def __init__(
        self, request_id: int, request: GenerationRequest, sampling: SamplingParams | None
    ) -> None:
        self.request_id = request_id
        self.request = request
        self.sampling = sampling  # checked on the HTTP side: the engine thread never refuses it
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent | Finished] = asyncio.Queue()
        self.done = False  # set on the engine thread once Finished is pushed
        self.submitted_s = time.monotonic()
        self.first_token_s: float | None = None  # set on the engine thread

    def push(self, event: TokenEvent | Finished) -> None:
        """From any thread: deliver `event` on the loop that submitted the request."""
        if isinstance(event, Finished):
            self.done = True
        # RuntimeError: the client's event loop is gone; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[TokenEvent | Finished]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                return


@dataclass(frozen=True)
class _Submit:
    handle: LiveHandle


@dataclass(frozen=True)
class _End:
    request_id: int
    discard: bool


@dataclass(frozen=True)
class _AbortAll:
    reason: str


_Command = _Submit | _End | _AbortAll

#: Told of every request that ended: prompt ids, output ids, why.
FinishedListener = Callable[[Sequence[int], Sequence[int], FinishReason], None]


class LiveArrivals:
    """The driver's `Arrivals` for a server: requests come from a thread-safe inbox.

    Everything but `put` and `close` runs on the engine thread."""

    def __init__(self, scheduler: Scheduler, on_finished: FinishedListener) -> None:
        self._scheduler = scheduler
        self._inbox: deque[_Command] = deque()
        self._wake = threading.Event()
        self._open = True
        self.handles: dict[int, LiveHandle] = {}
        self._on_finished = on_finished

    # -- from the HTTP side (any thread) -------------------------------------------------

    def put(self, command: _Command) -> None:
        self._inbox.append(command)  # deque.append is atomic
        self._wake.set()

    def close(self) -> None:
        """No request comes any more: the loop ends once the last one is served."""
        self._open = False
        self._wake.set()

    # -- the Arrivals protocol (the engine thread) ---------------------------------------

    def __bool__(self) -> bool:
        return self._open or bool(self._inbox)

    def next_arrival_s(self) -> float | None:
        return None  # arrivals are unknown until they come

    def idle(self, backend: Backend, now_s: float) -> None:
        self._wake.wait(IDLE_WAIT_S)
        self._wake.clear()

    def admit_due(self, scheduler: Scheduler, now_s: float) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, _Submit):
                self._admit(command.handle, now_s)
            elif isinstance(command, _End):
                self._end(command.request_id, now_s, discard=command.discard)
            else:
                for request_id in list(self.handles):
                    self._end(request_id, now_s, discard=True, error=command.reason)

    def finished(self, request_id: int, output_ids: Sequence[int], done_s: float) -> None:
        """The loop is done with a request that ended in a step: forget it (a server runs
        for days and keeps no history; `on_step` already told the client)."""
        self._scheduler.forget(request_id)

    def on_step(self, plan: StepPlan, output: StepOutput, done: Sequence[int]) -> None:
        """The driver's step listener: stream each sampled token (with its logprobs when
        asked for), end finished requests."""
        for request_id, token_id in output.sampled.items():
            handle = self.handles.get(request_id)
            if handle is not None:
                if handle.first_token_s is None:
                    handle.first_token_s = time.monotonic()
                handle.push(TokenEvent(token_id, output.logprobs.get(request_id)))
        for request_id in done:
            self._tell(request_id)

    def _admit(self, handle: LiveHandle, now_s: float) -> None:
        request = handle.request
        self.handles[handle.request_id] = handle
        admission = self._scheduler.add_request(
            handle.request_id, request.prompt_ids, request.max_new_tokens, now_s,
            cache_salt=request.cache_salt, stop_token_ids=request.stop_token_ids,
            sampling=handle.sampling, options=request.options,
        )  # fmt: skip
        if admission.refusal is not None:
            self._tell(handle.request_id, error=admission.refusal.message)
            self._scheduler.forget(handle.request_id)

    def _end(
        self, request_id: int, now_s: float, *, discard: bool, error: str | None = None
    ) -> None:
        if request_id not in self.handles:
            return  # it ended meanwhile
        if self._scheduler.end_request(request_id, now_s, discard=discard):
            self._tell(request_id, error=error)
            self._scheduler.forget(request_id)

    def _tell(self, request_id: int, *, error: str | None = None) -> None:
        """Tell the client its request ended, and forget its handle."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return
        run = self._scheduler.runs[request_id]
        if run.abort_reason is not None:
            error = run.abort_reason
            log.warning(f"request {request_id} aborted: {error}")
        reason = _FINISH_REASONS[run.finish_reason or SchedulerFinish.ABORT]
        # Counted before the client hears of it: a client that saw its Finished sees
        # the open count and the metrics without it.
        self._on_finished(run.prompt_ids, run.output_ids, reason)
        finished = Finished(
            reason=reason,
            prompt_tokens=len(run.prompt_ids),
            cached_tokens=min(run.prefix_hit_tokens, len(run.prompt_ids)),
            completion_tokens=len(run.output_ids),
            error=error,
        )
        handle.push(finished)
        first_s = handle.first_token_s
        access_log.info(
            RequestLine(
                request_id, finished.prompt_tokens, finished.cached_tokens,
                finished.completion_tokens,
                None if first_s is None else first_s - handle.submitted_s, reason.value,
            ).text()
        )  # fmt: skip


def _sampling(request: GenerationRequest) -> SamplingParams | None:
    """The request's sampling (None: greedy), or InvalidRequest (400) for a value outside
    the sampling rule: refused here, before the request reaches the engine thread."""
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    try:
        return sampling_or_greedy(request.temperature, seed, request.top_p, request.top_k)
    except KvSwapError as error:
        raise InvalidRequest(str(error)) from None


class EngineThreadService(EngineService):
    """`EngineService` over an `Engine` whose driver loop runs in its own thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_id: str,
        max_prompt_tokens: int | None = None,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        stats_interval_s: float | None = None,
    ) -> None:
        """`stats_interval_s`: log a stats line that often while steps run (None: never)."""
        self.engine = engine
        self._stats = StatsLine(stats_interval_s) if stats_interval_s is not None else None
        self.model_id = model_id
        # The scheduler's own rule (the model's positions, the GPU tier), asked once.
        self.max_model_tokens = engine.scheduler.max_request_tokens()
        self.vocab_size = engine.arch.vocab_size
        self.max_prompt_tokens = min(max_prompt_tokens or self.max_model_tokens,
                                     self.max_model_tokens)  # fmt: skip
        self.max_waiting_requests = max_waiting_requests
        self._scheduler = engine.scheduler
        control = engine.settings.control
        self._max_open = control.scheduler.max_num_seqs + max_waiting_requests
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._num_open = 0  # submitted, not yet finished
        self._all_done = threading.Condition(self._lock)
        self._stopping = False
        self._error: BaseException | None = None
        self.exporter = PrometheusExporter(
            block_bytes=engine.layout.block_bytes,
            block_tokens=control.layout.block_tokens,
            watermarks=Watermarks.from_swap_settings(control.swap),
            kv_metrics=engine.swapper.metrics,
            remote_counters=engine.remote_counters,
        )
        registry = self.exporter.registry
        # vLLM's vllm:prompt_tokens_total and vllm:request_success_total{finished_reason}.
        self._prompt_tokens = Counter(
            "kvswap_prompt_tokens", "Prompt tokens of requests that ended", registry=registry
        )
        self._requests = Counter(
            "kvswap_requests", "Requests that ended, by finish reason", ("finished_reason",),
            registry=registry,
        )  # fmt: skip
        self.arrivals = LiveArrivals(engine.scheduler, self._finished)
        self._thread = threading.Thread(target=self._run, name="kvswap-engine", daemon=True)
        self._thread.start()

    # -- EngineService -------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        num_prompt = len(request.prompt_ids)
        if num_prompt > self.max_prompt_tokens:
            raise PromptTooLong(
                f"the prompt has {num_prompt} tokens; allowed: at most {self.max_prompt_tokens}"
            )
        if (
            request.prompt_ids
            and not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < self.vocab_size
        ):
            # One bad id would fail the step of every request sharing it.
            raise InvalidRequest(
                f"the prompt's token ids must be in [0, {self.vocab_size}); "
                f"got {min(request.prompt_ids)}..{max(request.prompt_ids)}"
            )
        biased = [token for token, _ in request.options.logit_bias] if request.options else []
        if biased and biased[-1] >= self.vocab_size:  # sorted: the last is the largest
            raise InvalidRequest(
                f"logit_bias: token id {biased[-1]} is outside the vocabulary "
                f"(0..{self.vocab_size - 1})"
            )
        sampling = _sampling(request)
        refusal = self._scheduler.admission(num_prompt, request.max_new_tokens).refusal
        if refusal is not None:
            raise PromptTooLong(f"this request {refusal.message}")
        with self._lock:
            if self._stopping or self._error is not None:
                raise ServiceStopping("the server is stopping; no new requests are accepted")
            if self._num_open >= self._max_open:
                raise QueueFull(
                    f"{self._num_open} requests are open; allowed: {self._max_open} "
                    f"(max_num_seqs + max_waiting_requests); retry later",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._num_open += 1
        handle = LiveHandle(next(self._ids), request, sampling)
        self.arrivals.put(_Submit(handle))
        return handle

    def stop_early(self, handle: RequestHandle) -> None:
        self.arrivals.put(_End(handle.request_id, discard=False))

    def cancel(self, handle: RequestHandle) -> None:
        log.info(f"request {handle.request_id} cancelled: the client disconnected")
        self.arrivals.put(_End(handle.request_id, discard=True))

    def metrics_text(self) -> tuple[bytes, str]:
        return self.exporter.exposition().encode(), CONTENT_TYPE_LATEST

    def healthy(self) -> bool:
        return self._error is None and not self._stopping and self._thread.is_alive()

    @property
    def num_open_requests(self) -> int:
        with self._lock:
            return self._num_open

    def close(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            if self._num_open and not self._stopping:
                log.info(f"draining {self._num_open} open requests (up to {timeout_s:g} s)")
            self._stopping = True
            while self._num_open and self._thread.is_alive():
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    break
                self._all_done.wait(min(left_s, 0.1))
        if self._num_open:
            log.warning(f"aborting {self._num_open} requests still open at the drain deadline")
            self.arrivals.put(_AbortAll("the server is stopping"))
        self.arrivals.close()
        self._thread.join()  # the loop ends at its next step; it then releases the pools

    # -- the engine thread ---------------------------------------------------------------

    def _finished(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], reason: FinishReason
    ) -> None:
        self._prompt_tokens.inc(len(prompt_ids))
        self._requests.labels(reason.value).inc()
        # The gauges as of now: a request that ends without a step after it (an abort,
        # a disconnect) must not leave them at their last step's values.
        scheduler = self._scheduler
        self.exporter.set_queue_sizes(
            len(scheduler.running), len(scheduler.waiting), len(scheduler.preempted)
        )
        with self._lock:
            self._num_open -= 1
            self._all_done.notify_all()

    def _run(self) -> None:
        try:
            driver = Driver(
                self.engine.control, self.engine, self.arrivals,
                num_requests=lambda: self._num_open,
                observers=tuple(o for o in (self.exporter, self._stats) if o is not None),
                listener=self.arrivals.on_step,
            )  # fmt: skip
            while driver.step():
                pass
            driver.summary()
        except BaseException as error:
            self._error = error
            log.error(f"the engine stopped: {error}")
            for request_id in list(self.arrivals.handles):
                handle = self.arrivals.handles.pop(request_id)
                handle.push(Finished(FinishReason.ABORT, len(handle.request.prompt_ids), 0, 0,
                                     error=f"the engine stopped: {error}"))  # fmt: skip
            with self._lock:
                self._num_open = 0
                self._all_done.notify_all()
        finally:
            self.engine.close()


def build_engine_service(
    settings: EngineSettings,
    *,
    served_model_name: str | None = None,
    max_prompt_tokens: int | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    stats_interval_s: float | None = None,
) -> EngineThreadService:
    """The engine for `kvswap serve`, built from its settings record; the model's name in
    the API is `served_model_name`, else the model's (`model_id`). `max_prompt_tokens`
    None: the longest a request may be."""
    engine = Engine(settings)
    try:
        return EngineThreadService(
            engine,
            model_id=served_model_name or model_id(settings.options.model),
            max_prompt_tokens=max_prompt_tokens,
            max_waiting_requests=max_waiting_requests,
            stats_interval_s=stats_interval_s,
        )
    except BaseException:
        engine.close()
        raise


def model_id(model: str) -> str:
    """A model's name as clients see it: a preset's name, a directory's basename."""
    return Path(model).name or model
