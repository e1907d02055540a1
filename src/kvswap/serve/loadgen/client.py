"""An OpenAI-compatible HTTP client for load generation: model list and streamed requests.

One `httpx.AsyncClient` per run, on the caller's asyncio loop; nothing blocks.
Requests carry only standard fields, so kvswap serve, vLLM and SGLang all take
them unchanged:

    POST {api}/chat/completions  {"model", "messages", "max_tokens", "stream": true,
                                  "stream_options": {"include_usage": true}, "temperature": 0}
    POST {api}/completions       the same with "prompt" instead of "messages"

The answer is Server-Sent Events: `data: {json chunk}` lines, then `data: [DONE]`.
Every chunk that carries text is timed when its line arrives (`time.perf_counter`);
the last chunk holding `usage` gives prompt, completion and cached token counts.
A failed request comes back as a `StreamResult` with `error` (one line), never
as an exception: one bad request must not end a load test.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from kvswap.errors import KvSwapError
from kvswap.obs.loadgen_findings import BAD_STREAM, TIMEOUT, TRANSPORT, http_kind
from kvswap.redact import redact_url
from kvswap.serve.loadgen.prompts import Endpoint

PATHS: dict[Endpoint, str] = {"chat": "/chat/completions", "completions": "/completions"}
MAX_ERROR_BODY_BYTES = 4096
MAX_ERROR_CHARS = 200
_ERRNO = re.compile(r"^\[Errno -?\d+\]\s*")


@dataclass
class StreamResult:
    """What one streamed request returned. `status` is None when no HTTP answer came."""

    status: int | None = None
    text: str = ""  # the reply's content, exactly as streamed
    chunk_times_s: list[float] = field(default_factory=list)  # perf_counter per text chunk
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_kind: str | None = None  # with `error`: "HTTP <status>", "timeout", "transport", ...


def api_base(url: str) -> str:
    """The API root for `url`: `http://host:8000` and `http://host:8000/v1` both give
    `http://host:8000/v1`. A URL that is not http(s) with a host (and a port in 1..65535,
    no query, no fragment, no space or control character) is a user error, one line."""
    problem = _url_problem(url)
    if problem is not None:
        raise KvSwapError(
            f"--url {redact_url(url)!r}: {problem}; allowed: an http:// or https:// URL of the "
            "server, e.g. http://127.0.0.1:8000"
        )
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    root = f"{parts.scheme}://{parts.netloc}{path}"
    return root if path.endswith("/v1") else f"{root}/v1"


def _url_problem(url: str) -> str | None:
    """What is wrong with `url` as the server's address, or None. Checked as both readers
    see it: urlsplit (here) and httpx (the client), whose errors are not KvSwapErrors."""
    if any(char.isspace() or not char.isprintable() for char in url):
        return "it holds a space or an unprintable character"
    try:
        parts = urlsplit(url)
    except ValueError as error:  # "Invalid IPv6 URL"
        return str(error)
    try:
        port = parts.port  # parsed only when asked for: out of range, not a number
    except ValueError:
        port = 0
    if port == 0:
        return "the port is not a number in 1..65535"
    try:
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as error:  # a bad IP literal, say
        return one_line(str(error))
    if parts.scheme not in ("http", "https"):
        return "not http or https"
    if not parts.hostname:
        return "no host"
    if parts.query or parts.fragment:
        return "a query or a fragment"
    return None


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line, whitespace collapsed, at most `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def transport_reason(error: httpx.HTTPError) -> str:
    """Why a request got no answer, without the errno prefix."""
    text = _ERRNO.sub("", str(error)) or type(error).__name__
    return one_line(text)


def error_message(body: bytes) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, or the body's text."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return one_line(text) or "(empty body)"
    if isinstance(data, Mapping):
        inner = data.get("error")
        if isinstance(inner, Mapping):
            inner = inner.get("message")
        for value in (inner, data.get("detail"), data.get("message")):
            if isinstance(value, str) and value:
                return one_line(value)
    return one_line(text)


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, other fields, blank lines."""
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def apply_chunk(result: StreamResult, chunk: object, endpoint: Endpoint, now_s: float) -> None:
    """Fold one parsed chunk into `result`: text (timed), usage, or an in-stream error."""
    if not isinstance(chunk, Mapping):
        result.error = f"stream chunk is not a JSON object: {one_line(repr(chunk), 60)}"
        return
    error = chunk.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else error
        result.error = f"error in stream: {one_line(str(message))}"
        return
    usage = chunk.get("usage")
    if isinstance(usage, Mapping):
        result.completion_tokens = _count(usage.get("completion_tokens"))
        result.prompt_tokens = _count(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping):
            result.cached_tokens = _count(details.get("cached_tokens"))
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return
    choice = choices[0]
    if endpoint == "completions":
        text, timed = choice.get("text"), ""
    else:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, Mapping) else {}
        text = delta.get("content")
        # Reasoning models stream their thinking apart from the reply: it is output
        # the server generated (timed) but not part of the conversation's text.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        timed = reasoning if isinstance(reasoning, str) else ""
    content = text if isinstance(text, str) else ""
    result.text += content
    if content or timed:
        result.chunk_times_s.append(now_s)


class OpenAIClient:
    """`async with OpenAIClient(...) as client:` then `served_models()` and `stream()`."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        max_connections: int | None,
    ):
        self.base = api_base(url)
        self.shown_url = redact_url(url)
        headers = {"Accept": "text/event-stream, application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(
            headers=headers,
            # `pool=None`: a request waiting for a connection is not an error; the
            # replay's own deadline and --timeout-s bound it instead.
            timeout=httpx.Timeout(timeout_s, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None),
            follow_redirects=False,
        )

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._http.aclose()

    async def served_models(self) -> list[str]:
        """The model ids of GET /v1/models; a one-line KvSwapError when the server is
        unreachable, refuses the key, or is not OpenAI-compatible."""
        where = f"{self.base}/models"
        try:
            response = await self._http.get(where)
        except httpx.HTTPError as error:
            raise KvSwapError(
                f"cannot reach {self.shown_url}: {transport_reason(error)}; "
                "is the server running and the URL right?"
            ) from None
        shown = redact_url(where)
        if response.status_code in (401, 403):
            raise KvSwapError(
                f"{shown}: HTTP {response.status_code} ({error_message(response.content)}); "
                "give the server's key with --api-key KEY or OPENAI_API_KEY"
            )
        not_openai = f"{self.shown_url} is not an OpenAI-compatible server: GET {shown}"
        if response.status_code != 200:
            raise KvSwapError(f"{not_openai} answered HTTP {response.status_code}")
        try:
            data = json.loads(response.content)
        except ValueError:
            data = None
        models = data.get("data") if isinstance(data, Mapping) else None
        if not isinstance(models, list):
            raise KvSwapError(f"{not_openai} did not return a model list")
        return [m["id"] for m in models if isinstance(m, Mapping) and isinstance(m.get("id"), str)]

    async def stream(self, endpoint: Endpoint, body: Mapping[str, object]) -> StreamResult:
        """POST `body` to `endpoint` and read its SSE answer to the end."""
        result = StreamResult()
        await self._read_stream(endpoint, body, result)
        if result.error is not None and result.error_kind is None:
            result.error_kind = BAD_STREAM
        return result

    async def _read_stream(
        self, endpoint: Endpoint, body: Mapping[str, object], result: StreamResult
    ) -> None:
        try:
            async with self._http.stream("POST", self.base + PATHS[endpoint], json=body) as answer:
                result.status = answer.status_code
                if answer.status_code != 200:
                    result.error = f"HTTP {answer.status_code}: {await _error_body(answer)}"
                    result.error_kind = http_kind(answer.status_code)
                    return
                events = 0
                async for line in answer.aiter_lines():
                    payload = sse_data(line)
                    if payload is None:
                        continue
                    now_s = time.perf_counter()
                    events += 1
                    if payload.strip() == "[DONE]":
                        break
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        result.error = f"stream data is not JSON: {one_line(payload, 60)}"
                        return
                    apply_chunk(result, chunk, endpoint, now_s)
                    if result.error is not None:
                        return
                if not events:
                    result.error = "not an event stream: the answer has no `data:` lines"
        except httpx.HTTPError as error:
            result.error = f"{type(error).__name__}: {transport_reason(error)}"
            result.error_kind = TIMEOUT if isinstance(error, httpx.TimeoutException) else TRANSPORT


async def _error_body(answer: httpx.Response) -> str:
    body = b""
    async for piece in answer.aiter_bytes():
        body += piece
        if len(body) >= MAX_ERROR_BODY_BYTES:
            break
    return error_message(body[:MAX_ERROR_BODY_BYTES])
