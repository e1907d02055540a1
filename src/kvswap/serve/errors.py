"""OpenAI error objects: every refusal of the HTTP app, one line each.

    HTTP 400  {"error": {"message": "tools: 1 given; this server does not call tools ...",
                         "type": "invalid_request_error", "param": "tools",
                         "code": "unsupported_parameter"}}

The status follows one rule, written here once (as the OpenAI API and vLLM answer):

    400  the body cannot be read (not JSON, not an object), asks for what this server
         does not do (an unknown field, tools, structured output, `echo`, a text prompt
         or a chat without a tokenizer, a prompt plus `max_tokens` longer than the
         model), or a known field holds a value of the wrong type or out of range (the
         sampling fields' ranges: kvswap.sampling), or a required field is missing
    401  the API key is missing or wrong
    404  an unknown route or model
    405  a known route with the wrong method
    408  the body did not arrive within --body-read-timeout-s (the connection is closed)
    413  the prompt over `--max-prompt-tokens`, or the body over its byte limit
    429  the waiting queue is full; `Retry-After` says when to try again
    500  a bug in the server (its log has the traceback)
    503  the server is stopping or its engine has stopped

Messages are one line: newlines from any source are folded into spaces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvswap.errors import KvSwapError
from kvswap.serve.server_log import log
from kvswap.serve.service import ServiceError
from kvswap.serve.text_errors import TextRequestError

#: OpenAI's error `type` for each status the app answers with.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
#: Seconds a 429 asks a client to wait when the service gives no figure.
DEFAULT_RETRY_AFTER_S = 1.0


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(text.split())


class ApiError(KvSwapError):
    """A request the app refuses: its status, and the OpenAI error object to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(one_line(message))
        self.status = status
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def message(self) -> str:
        return str(self)

    def to_json(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_json(), status_code=self.status, headers=self.headers)


def from_status_error(
    error: ServiceError | TextRequestError, *, param: str | None = None
) -> ApiError:
    """A refusal of the service (prompt too long, queue full, stopping) or of the text
    layer (bad messages, no tokenizer) as an API error, with the status it carries."""
    headers: dict[str, str] = {}
    retry_after_s = error.retry_after_s if isinstance(error, ServiceError) else None
    if error.status == 429 or retry_after_s is not None:
        wait_s = retry_after_s if retry_after_s is not None else DEFAULT_RETRY_AFTER_S
        # Retry-After takes whole seconds (RFC 9110); round up so a client never comes early.
        headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
    return ApiError(error.status, str(error), code=error.code, param=param, headers=headers)


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown route, wrong method) as OpenAI error objects."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"{request.method} {request.url.path}: no such route"
        return ApiError(404, message, code="not_found").response()
    if exc.status_code == 405:
        allowed = exc.headers.get("Allow", "") if exc.headers else ""
        message = f"{request.method} {request.url.path}: method not allowed (allowed: {allowed})"
        return ApiError(405, message, code="method_not_allowed", headers=exc.headers).response()
    return ApiError(exc.status_code, str(exc.detail), code="http_error").response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug, not the client's doing: an error object all the same (starlette re-raises
    the exception afterwards, so the server's log gets its traceback)."""
    message = f"{request.method} {request.url.path}: internal server error ({type(exc).__name__})"
    return ApiError(500, message, code="internal_error").response()


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    # Every refusal is one line in the server's log (a 413 or a 429 is an operator's
    # concern too); the client gets the same message.
    log.warning(f"{request.method} {request.url.path}: {exc.status} {exc.message}")
    return exc.response()
