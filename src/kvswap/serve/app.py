"""The OpenAI-compatible HTTP app (starlette) over an `EngineService`.

    POST /v1/completions        prompt: text or token ids; stream or not
    POST /v1/chat/completions   messages rendered by the model's chat template
    GET  /v1/models             the one served model
    GET  /v1/models/{model}     its card (404 for any other name)
    GET  /health                200 while the engine runs, 503 once it stopped
    GET  /metrics               the service's Prometheus text (same port)

With an API key every /v1 route needs `Authorization: Bearer <key>` (compared in
constant time); /health and /metrics stay open for probes and scrapers, as in vLLM.

Nothing here waits on compute: `submit` only enqueues, tokens arrive as events on
this loop, and tokenizing a prompt (and rendering a chat) runs in a worker thread.
A client that leaves is noticed, streaming or not, and its request is cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvswap.errors import KvSwapError
from kvswap.serve.errors import (
    ApiError,
    api_error,
    from_status_error,
    http_exception,
    internal_error,
)
from kvswap.serve.http_generation import (
    Generation,
    OutputText,
    choice_requests,
    plan_generation,
    submit_all,
)
from kvswap.serve.http_logprobs import LogprobsWriter
from kvswap.serve.http_responses import CHAT_SHAPE, COMPLETION_SHAPE, ResponseShape, ResponseWriter
from kvswap.serve.http_stream import Choice, collect, event_stream
from kvswap.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvswap.serve.service import EngineService
from kvswap.serve.text_errors import TextRequestError
from kvswap.serve.tokenizer import TextCodec

#: A body past this is refused before it is parsed (413) where no model sets the limit
#: (`kvswap serve` derives it from the model's longest prompt: `body_limit_bytes`).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: JSON bytes a prompt character may take: outside the BMP, two `\uXXXX` escapes.
JSON_BYTES_PER_CHAR = 12
#: JSON bytes a prompt token may take beside its text: an id (up to 10 digits and ", "),
#: or a chat message's framing ({"role": "user", "content": ""}, at least one token each).
JSON_BYTES_PER_TOKEN = 48
#: Room for the fields beside the prompt (sampling, stop strings, names).
BODY_OVERHEAD_BYTES = 64 * 1024
#: Bodies up to this are parsed on the event loop (well under a millisecond); longer
#: ones in a worker thread, like tokenizing, so a long prompt never stalls other clients.
INLINE_PARSE_BYTES = 64 * 1024
#: A request's whole body must arrive within this many seconds of its headers (408):
#: a client trickling its body holds a connection, a task and a buffer meanwhile.
BODY_READ_TIMEOUT_S = 30.0
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True)
class AppSettings:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: The model's ids: a token-id prompt is checked against them, so no id outside the
    #: embedding ever reaches the engine (None: the tokenizer's, when there is one).
    model_vocab_size: int | None = None
    body_read_timeout_s: float = BODY_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        timeout_s = self.body_read_timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise KvSwapError(f"body_read_timeout_s {timeout_s}: allowed: a number > 0")


def body_limit_bytes(max_prompt_tokens: int, codec: TextCodec | None) -> int:
    """The largest body a prompt the model can take needs: every token at its longest
    text (each character escaped at its longest), its framing, and the other fields."""
    chars_per_token = codec.max_prompt_chars(1) if codec is not None else 0
    per_token_bytes = chars_per_token * JSON_BYTES_PER_CHAR + JSON_BYTES_PER_TOKEN
    return max_prompt_tokens * per_token_bytes + BODY_OVERHEAD_BYTES


def build_app(
    service: EngineService, codec: TextCodec | None, settings: AppSettings | None = None
) -> Starlette:
    """The app; `codec` None serves token-id prompts only (a model without a tokenizer)."""
    settings = settings or AppSettings()
    api = _Api(service, codec, settings)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            HTTPException: http_exception,
            ApiError: api_error,
            Exception: internal_error,
        },
    )
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


class _Api:
    def __init__(self, service: EngineService, codec: TextCodec | None, settings: AppSettings):
        self.service = service
        self.codec = codec
        self.settings = settings
        self.created = int(time.time())
        self.vocab_size = settings.model_vocab_size
        if self.vocab_size is None and codec is not None:
            self.vocab_size = codec.vocab_size

    # -- the endpoints -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._parse(CompletionRequest, request)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            codec = self._codec()
            prompt = body.prompt
            self._check_text_fits(codec, len(prompt), "prompt")
            prompt_ids = await self._encode(lambda: codec.encode(prompt, add_special_tokens=True))
        else:
            prompt_ids = body.prompt
        return await self._generate(request, body, prompt_ids, COMPLETION_SHAPE)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(ChatCompletionRequest, request)
        self._check_model(body.model)
        codec = self._codec()
        num_chars = sum(len(message.content or "") for message in body.messages)
        self._check_text_fits(codec, num_chars, "messages")
        messages = [message.to_template() for message in body.messages]
        prompt_ids = await self._encode(lambda: codec.encode_chat(messages))
        return await self._generate(request, body, prompt_ids, CHAT_SHAPE)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card (`client.models.retrieve`)."""
        self._check_model(str(request.path_params["model"]))
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, object]:
        return {
            "id": self.service.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "kvswap",
            "root": self.service.model_id,
            "parent": None,
            "max_model_len": self.service.max_model_tokens,
        }

    async def health(self, request: Request) -> Response:
        if self.service.healthy():
            return JSONResponse({"status": "ok"})
        message = "the engine is not running (the server is stopping, or the engine stopped)"
        return ApiError(503, message, code="service_unavailable").response()

    async def metrics(self, request: Request) -> Response:
        text, content_type = self.service.metrics_text()
        return Response(text, headers={"Content-Type": content_type})

    # -- the steps -----------------------------------------------------------------------

    async def _parse(self, model: type[Body], request: Request) -> Body:
        raw = await self._body(request)
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse_body(model, raw, vocab_size=self.vocab_size)
        # A long prompt: parsed off the loop.
        return await asyncio.to_thread(parse_body, model, raw, vocab_size=self.vocab_size)

    async def _body(self, request: Request) -> bytes:
        """The raw body, refused (413) as soon as it passes the byte limit, and (408) when
        it has not all arrived within `body_read_timeout_s`. A client that leaves while
        sending it ends the request quietly: nobody is there to read an answer."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _body_too_large(limit)
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _body_too_large(limit)
                chunks.append(chunk)

        timeout_s = self.settings.body_read_timeout_s
        try:
            await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"request body: not received within {timeout_s:g} s; send it at once",
                code="request_timeout", headers={"Connection": "close"},
            ) from None  # fmt: skip
        except ClientDisconnect:
            # Answered to nobody: uvicorn drops what is sent on a closed connection.
            raise ApiError(499, "the client closed the connection", code="client_closed") from None
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_id:
            raise ApiError(
                404, f"model {model!r} does not exist; this server serves "
                f"{self.service.model_id!r} (see GET /v1/models)",
                code="model_not_found", param="model",
            )  # fmt: skip

    def _codec(self, param: str = "prompt") -> TextCodec:
        if self.codec is None:
            raise ApiError(
                400, f"model {self.service.model_id!r} has no tokenizer, so text (prompts, "
                "chat messages, stop strings) cannot be tokenized; give the prompt as token "
                "ids (a list of integers) to /v1/completions, without stop strings",
                code="no_tokenizer", param=param,
            )  # fmt: skip
        return self.codec

    def _check_text_fits(self, codec: TextCodec, num_chars: int, param: str) -> None:
        """413 before tokenizing, for a text too long to fit whatever its tokens: a
        30 MiB prompt must not cost seconds of tokenizing and a GB of memory first."""
        max_tokens = self.service.max_prompt_tokens
        max_chars = codec.max_prompt_chars(max_tokens)
        if num_chars > max_chars:
            raise ApiError(
                413, f"{param}: {num_chars} characters cannot fit in {max_tokens} tokens (no "
                f"token of this tokenizer is longer than {codec.max_prompt_chars(1)} "
                f"characters); allowed: at most {max_chars} characters",
                code="context_length_exceeded", param=param,
            )  # fmt: skip

    async def _encode(self, encode: Callable[[], list[int]]) -> tuple[int, ...]:
        try:
            return tuple(await asyncio.to_thread(encode))
        except TextRequestError as error:
            raise from_status_error(error) from None

    async def _generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: tuple[int, ...],
        shape: ResponseShape,
    ) -> Response:
        sampling = body.sampling()
        stop_ids: frozenset[int] = frozenset()
        if self.codec is not None and not body.ignore_eos:
            stop_ids = self.codec.eos_token_ids
        if body.stop:
            self._codec("stop")
        planned = plan_generation(
            prompt_ids, sampling, self.service, stop_token_ids=stop_ids,
            vocab_size=self.vocab_size, max_tokens_field=body.max_tokens_field,
            logprobs_field=body.logprobs_field,
        )  # fmt: skip
        outputs = [
            OutputText(self.codec, prompt_ids, body.stop, min_tokens=sampling.min_tokens)
            for _ in range(sampling.n)
        ]  # built before submitting: a bad stop string must not leave requests queued
        handles = submit_all(self.service, choice_requests(planned, sampling.n))
        choices = [
            Choice(
                index, Generation(self.service, handle, output),
                None if sampling.num_logprobs is None
                else LogprobsWriter(self.codec, chat=shape.chat),
            )
            for index, (handle, output) in enumerate(zip(handles, outputs, strict=True))
        ]  # fmt: skip
        writer = ResponseWriter(shape, self.service.model_id, include_usage=body.include_usage)
        with_ids = self.codec is None
        if body.streaming:
            return event_stream(choices, writer, with_token_ids=with_ids)
        return await collect(request, choices, writer, with_token_ids=with_ids)


def _body_too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"request body: over {limit} bytes; send a shorter prompt",
        code="request_too_large",
    )  # fmt: skip


class ApiKeyMiddleware:
    """Every /v1 route answers 401 unless `Authorization: Bearer <api_key>` comes with it."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        # compare_digest takes time independent of where the bytes first differ.
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        what = "missing" if not given else "wrong"
        error = ApiError(
            401, f"API key {what}: send the header `Authorization: Bearer <key>` with the key "
            "this server was started with (--api-key or KVSWAP_API_KEY)",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
        await error.response()(scope, receive, send)
