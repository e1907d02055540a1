"""A small OpenAI-compatible server for the load generator's tests.

starlette + uvicorn on a free loopback port, in a thread with its own event loop.
It streams deterministic replies: request n (in arrival order) answers
`max_tokens` words "r{n}w{i}", one SSE chunk each, then a usage chunk whose
cached_tokens is the longest word prefix shared with an earlier prompt. It
records every body it received and counts what it served to the end.

Its "tokenizer" counts `tokens_per_word` tokens per word (its own reply words
one each, as they were generated), plus `request_overhead_tokens` per request and
`message_overhead_tokens` per message after the first (a chat template's
wrappers), so calibration has something to find; the default is one token per
word and no overhead.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "stub-model"
REPLY_WORD = re.compile(r"r\d+w\d+")


@dataclass
class Served:
    """One request as the stub saw it."""

    number: int
    path: str
    body: dict[str, object]
    reply: str = ""
    completed: bool = False


@dataclass
class StubOptions:
    chunk_delay_s: float = 0.0
    # A server that admits one request at a time, each for this long before its first
    # token: requests sent together queue (the k-th waits k x admit_s).
    admit_s: float = 0.0
    with_usage: bool = True
    fail_every: int | None = None  # request n fails with HTTP 500 when n % fail_every == 0
    tokens_per_word: int = 1
    request_overhead_tokens: int = 0
    message_overhead_tokens: int = 0
    max_prompt_tokens: int | None = None  # longer prompts: HTTP 413
    openai: bool = True  # False: no /v1 routes at all (a plain web server)
    api_key: str | None = None
    ignore_stream: bool = False  # answer one JSON object, as a server without streaming
    models: tuple[str, ...] = (MODEL,)


@dataclass
class StubState:
    served: list[Served] = field(default_factory=list)
    prompts: list[list[str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def completed(self) -> list[Served]:
        with self.lock:
            return [s for s in self.served if s.completed]

    @property
    def tokens_served(self) -> int:
        return sum(len(s.reply.split()) for s in self.completed)

    def replayed(self, num_probes: int) -> list[Served]:
        """The requests of the replay served to the end: the load generator sends
        its `num_probes` calibration probes before any of them."""
        with self.lock:
            return [s for s in self.served[num_probes:] if s.completed]


def _prompt_words(body: dict[str, object]) -> list[str]:
    messages = body.get("messages")
    if isinstance(messages, list):
        return [w for m in messages for w in str(m.get("content", "")).split()]
    return str(body.get("prompt", "")).split()


def _shared_prefix(a: list[str], b: list[str]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class StubServer:
    def __init__(self, options: StubOptions | None = None):
        self.options = options or StubOptions()
        self.state = StubState()
        self._admission: asyncio.Lock | None = None  # made on the server's loop
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        routes = []
        if self.options.openai:
            routes = [
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
            ]
        config = uvicorn.Config(Starlette(routes=routes), log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self._server.run(sockets=[self._socket])

    def __enter__(self) -> StubServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the stub server did not start")
            threading.Event().wait(0.01)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def _authorized(self, request: Request) -> bool:
        key = self.options.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"

    async def _models(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        data = [{"id": name, "object": "model"} for name in self.options.models]
        return JSONResponse({"object": "list", "data": data})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        with self.state.lock:
            served = Served(len(self.state.served), request.url.path, body)
            self.state.served.append(served)
            words = _prompt_words(body)
            cached = max((_shared_prefix(words, p) for p in self.state.prompts), default=0)
            self.state.prompts.append(words)
        options = self.options
        messages = body.get("messages")
        num_messages = len(messages) if isinstance(messages, list) else 1
        prompt_tokens = (
            sum(1 if REPLY_WORD.fullmatch(w) else options.tokens_per_word for w in words)
            + options.request_overhead_tokens
            + options.message_overhead_tokens * (num_messages - 1)
        )
        every = options.fail_every
        if every is not None and served.number % every == 0:
            message = f"stub failure for request {served.number}"
            return JSONResponse({"error": {"message": message}}, status_code=500)
        if options.max_prompt_tokens is not None and prompt_tokens > options.max_prompt_tokens:
            message = f"{prompt_tokens} prompt tokens; this stub takes {options.max_prompt_tokens}"
            return JSONResponse({"error": {"message": message}}, status_code=413)
        chat = request.url.path.endswith("/chat/completions")
        max_tokens = int(body["max_tokens"])
        if self.options.ignore_stream:
            return JSONResponse({"id": "stub", "choices": [{"index": 0, "text": "x"}]})
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached * options.tokens_per_word},
        }
        return StreamingResponse(
            self._chunks(served, chat, max_tokens, usage), media_type="text/event-stream"
        )

    async def _chunks(
        self, served: Served, chat: bool, max_tokens: int, usage: dict[str, object]
    ) -> AsyncIterator[str]:
        def event(choice: dict[str, object] | None, **extra: object) -> str:
            chunk = {
                "id": f"stub-{served.number}",
                "model": MODEL,
                "choices": [] if choice is None else [{"index": 0, **choice}],
                **extra,
            }
            return f"data: {json.dumps(chunk)}\n\n"

        if chat:
            yield event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        if self.options.admit_s:
            if self._admission is None:
                self._admission = asyncio.Lock()
            async with self._admission:
                await asyncio.sleep(self.options.admit_s)
        reply = []
        for i in range(max_tokens):
            if self.options.chunk_delay_s:
                await asyncio.sleep(self.options.chunk_delay_s)
            word = f"{'' if i == 0 else ' '}r{served.number}w{i}"
            reply.append(word)
            choice = {"delta": {"content": word}} if chat else {"text": word}
            yield event({**choice, "finish_reason": None})
        yield event(
            {"delta": {}, "finish_reason": "length"}
            if chat
            else {"text": "", "finish_reason": "length"}
        )
        if self.options.with_usage:
            yield event(None, usage=usage)
        yield ": a comment line, which clients ignore\n\n"
        # Counted before the last line goes out: the client may finish as soon as it reads it.
        served.reply = "".join(reply)
        served.completed = True
        yield "data: [DONE]\n\n"
