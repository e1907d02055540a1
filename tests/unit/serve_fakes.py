"""A fake EngineService for the HTTP tests: deterministic tokens from its own thread.

Like the real service, `submit` only enqueues and the tokens come from another
thread (here one "engine" thread that steps every open request each `step_s`),
delivered with `call_soon_threadsafe` on the loop that submitted. Each request
"generates" `reply_ids` in order (the reply of every request, unless one is given
for a prompt), then ends with LENGTH at `max_new_tokens`, STOP at a stop token,
STOP on `stop_early`, ABORT on `cancel` or `close`. A request whose options ask for
logprobs gets `fake_logprobs` of each token. Everything it was asked is recorded for
the tests to check.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

import httpx
from starlette.types import ASGIApp

from kvswap.sampling import TokenLogprobs
from kvswap.serve.app import AppSettings, build_app
from kvswap.serve.http_server import ApiServer, bind_listener
from kvswap.serve.service import (
    EngineService,
    Finished,
    FinishReason,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    ServiceStopping,
    TokenEvent,
)
from kvswap.serve.tokenizer import TextCodec

#: Seconds between two tokens of a request; small, the tests never measure time.
STEP_S = 0.002
#: A bound on waiting for a server thread, not a performance figure.
DEADLINE_S = 30.0
#: The same for a child process, which imports torch and builds an engine first.
CHILD_DEADLINE_S = 120.0


def fake_logprobs(token_id: int, num_top: int) -> TokenLogprobs:
    """What the fake reports for a token: -0.25 for it; its top list is the token, then
    the ids after it, each 1.0 less likely."""
    top = tuple((token_id + rank, -0.25 - rank) for rank in range(num_top))
    return TokenLogprobs(token_id, -0.25, top)


class FakeHandle(RequestHandle):
    def __init__(self, request_id: int, request: GenerationRequest, reply: Sequence[int]):
        self.request_id = request_id
        self.request = request
        self.reply = list(reply)
        self.sent = 0
        self.end: FinishReason | None = None  # what ends it at the next step
        self.extra_tokens = 0  # sent even so (tokens_after_stop)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent | Finished] = asyncio.Queue()

    def push(self, event: TokenEvent | Finished) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[TokenEvent | Finished]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                return


@dataclass
class FakeService(EngineService):
    reply_ids: Sequence[int] = (1, 2, 3)
    model_id: str = "fake-model"
    max_model_tokens: int = 256
    max_prompt_tokens: int = 128
    max_open_requests: int = 8
    cached_tokens: int = 0
    step_s: float = STEP_S
    #: Tokens still sent after `stop_early`, as an engine samples until it hears of it.
    tokens_after_stop: int = 0
    submitted: list[GenerationRequest] = field(default_factory=list)
    stopped_early: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    closed_with_s: list[float] = field(default_factory=list)
    alive: bool = True

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, FakeHandle] = {}
        self._stopping = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._engine, name="fake-engine", daemon=True)
        self._thread.start()
        self.cancel_seen = threading.Event()  # set at every cancel

    # -- EngineService -------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        with self._lock:
            if self._stopping:
                raise ServiceStopping("the server is stopping; no new requests are accepted")
            if len(self._open) >= self.max_open_requests:
                raise QueueFull(
                    f"{len(self._open)} requests are open; allowed: {self.max_open_requests}",
                    retry_after_s=2.5,
                )
            handle = FakeHandle(len(self.submitted), request, self.reply_ids)
            self.submitted.append(request)
            self._open[handle.request_id] = handle
        return handle

    def stop_early(self, handle: RequestHandle) -> None:
        self._end(handle, FinishReason.STOP, self.stopped_early)

    def cancel(self, handle: RequestHandle) -> None:
        self._end(handle, FinishReason.ABORT, self.cancelled)
        self.cancel_seen.set()

    def _end(self, handle: RequestHandle, reason: FinishReason, seen: list[int]) -> None:
        with self._lock:
            seen.append(handle.request_id)
            fake = self._open.get(handle.request_id)
            if fake is not None and fake.end is None:
                fake.end = reason
                if reason is FinishReason.STOP:
                    fake.extra_tokens = self.tokens_after_stop

    def metrics_text(self) -> tuple[bytes, str]:
        return b"# TYPE kvswap_fake_requests_total counter\nkvswap_fake_requests_total 1\n", (
            "text/plain; version=0.0.4; charset=utf-8"
        )

    def healthy(self) -> bool:
        return self.alive and not self._stopping

    def close(self, timeout_s: float) -> None:
        with self._lock:
            self.closed_with_s.append(timeout_s)
            self._stopping = True
            for handle in self._open.values():
                handle.end = handle.end or FinishReason.ABORT
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the "engine" thread -------------------------------------------------------------

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    def _engine(self) -> None:
        while True:
            with self._lock:
                if self._stopping and not self._open:
                    return
                for request_id, handle in list(self._open.items()):
                    if self._step(handle):
                        del self._open[request_id]
            self._wake.wait(self.step_s)

    def _step(self, handle: FakeHandle) -> bool:
        """One token, or the end; True once Finished was pushed."""
        request = handle.request
        reason = handle.end
        if reason is FinishReason.STOP and handle.extra_tokens:
            handle.extra_tokens -= 1
            reason = None
        last = handle.reply[(handle.sent - 1) % len(handle.reply)] if handle.sent else None
        if reason is None and last in request.stop_token_ids:
            reason = FinishReason.STOP
        if reason is None and handle.sent >= request.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            cached = min(self.cached_tokens, len(request.prompt_ids))
            error = "the server is stopping" if reason is FinishReason.ABORT else None
            handle.push(Finished(reason, len(request.prompt_ids), cached, handle.sent, error))
            return True
        token_id = handle.reply[handle.sent % len(handle.reply)]
        options = request.options
        logprobs = None
        if options is not None and options.num_logprobs is not None:
            logprobs = fake_logprobs(token_id, options.num_logprobs)
        handle.push(TokenEvent(token_id, logprobs))
        handle.sent += 1
        return False


# -- the app served by uvicorn in a background thread ------------------------------------


class RunningServer:
    """`ApiServer` over an app on a free loopback port, in a thread; `url` once ready."""

    def __init__(self, app: ASGIApp, service: EngineService, *, shutdown_timeout_s: float = 5.0):
        self.stdout = io.StringIO()
        self.listener = bind_listener("127.0.0.1", 0)
        self.server = ApiServer(
            app, service, model_name=service.model_id, shutdown_timeout_s=shutdown_timeout_s,
            stdout=self.stdout,
        )  # fmt: skip
        self.stop_signal: int | None = None
        self.error: BaseException | None = None  # what `run` raised
        self._thread = threading.Thread(target=self._run, name="api-server", daemon=True)

    def _run(self) -> None:
        try:
            self.stop_signal = self.server.run([self.listener])
        except BaseException as error:
            self.error = error

    def __enter__(self) -> RunningServer:
        self._thread.start()
        assert self.server.ready.wait(DEADLINE_S), "the server did not start"
        return self

    @property
    def url(self) -> str:
        assert self.server.url is not None
        return self.server.url

    def wait_until_stopped(self) -> None:
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the server did not stop"

    def stop(self) -> None:
        self.server.request_stop()
        self.wait_until_stopped()
        self.listener.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serving(
    service: EngineService, codec: TextCodec | None, settings: AppSettings | None = None
) -> Iterator[RunningServer]:
    with RunningServer(build_app(service, codec, settings), service) as running:
        yield running


# -- `python -m kvswap serve` as a child process -----------------------------------------


#: Each child's stderr, in a file: a pipe nobody reads during a test fills up with the
#: server's log (an access line per request) and blocks the server on its next line.
_STDERR_FILES: dict[int, IO[bytes]] = {}


def kvswap_process(*argv: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the ready line reaches the pipe at once
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - finish_process closes it
    process = subprocess.Popen(
        [sys.executable, "-m", "kvswap", *argv],
        stdout=subprocess.PIPE, stderr=stderr, env=env,
    )  # fmt: skip
    _STDERR_FILES[process.pid] = stderr
    return process


def wait_for_line(process: subprocess.Popen[bytes], prefix: str) -> str:
    """The child's first stdout line starting with `prefix` (bounded by CHILD_DEADLINE_S).

    Reads the raw descriptor with select(), so a line is seen when it is printed."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        data = os.read(fd, 65536) if ready else b""
        if not data:
            break
        seen += data
        for line in seen.decode(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
    process.kill()
    raise AssertionError(f"the child never printed {prefix!r}: {seen!r} {process.communicate()}")


def finish_process(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    """(exit code, stderr) once the child ends (killed past CHILD_DEADLINE_S)."""
    try:
        process.communicate(timeout=CHILD_DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
    return process.returncode, child_stderr(process)


def child_stderr(process: subprocess.Popen[bytes]) -> str:
    """Everything a `kvswap_process` child wrote to stderr (once it has ended); "" when
    it was read already."""
    stderr = _STDERR_FILES.pop(process.pid, None)
    if stderr is None:
        return ""
    stderr.seek(0)
    err = stderr.read()
    stderr.close()
    return err.decode(errors="replace")


def metric(url: str, name: str) -> dict[str, float]:
    """Every sample of `name` on `url`/metrics (any Prometheus exporter: kvswap serve,
    vLLM), by its label string ("" for none)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    for match in re.finditer(pattern, text, re.MULTILINE):
        found[match.group(1) or ""] = float(match.group(2))
    return found


@contextmanager
def kvswap_server(*argv: str) -> Iterator[str]:
    """`kvswap serve ARGV` as a child, running; yields its URL. At the end SIGTERM, and
    it must exit 0 (else its stderr is the failure); a kill if it is still alive."""
    process = kvswap_process("serve", *argv)
    try:
        line = wait_for_line(process, "kvswap serve: listening on ")
        yield line.split("listening on ")[1].split()[0]
        process.send_signal(signal.SIGTERM)
        code, err = finish_process(process)
        assert code == 0, err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
