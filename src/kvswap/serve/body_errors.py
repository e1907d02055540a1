"""pydantic's errors on a request body as one ApiError: one `field: what` part per problem.

    messages[0].role: allowed: system, developer, user, assistant (got 'bogus');
    best_of: unknown field; this server refuses fields it does not implement (known ...)

Everything a body can get wrong is reported at once, `; `-separated, at most
MAX_ERROR_PARTS named (the rest counted), so 100,000 bad chat messages cost one
short line. The status is 400 (as the OpenAI API and vLLM answer; see
kvswap.serve.errors); `code` says whether the server does not do what was asked
(`unsupported_parameter`) or a value is wrong (`invalid_value`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from kvswap.serve.errors import ApiError
from kvswap.serve.text_errors import unicode_problem

#: Error types that mean "this server does not do that"; every other is a bad value.
UNSUPPORTED_ERROR_TYPES = frozenset({"extra_forbidden", "unsupported"})
#: Problems named in one error message; the rest are counted ("and N more").
MAX_ERROR_PARTS = 5
_INPUT_SHOWN_CHARS = 40


def unsupported(message: str) -> PydanticCustomError:
    """A validator's refusal of what this server does not do (`unsupported_parameter`)."""
    return PydanticCustomError("unsupported", message)


def invalid(message: str) -> PydanticCustomError:
    """A validator's refusal of a bad value (`invalid_value`)."""
    return PydanticCustomError("invalid_value", message)


def valid_text(text: str) -> str:
    """`text` if it is valid Unicode; else the refusal naming its lone surrogate."""
    problem = unicode_problem(text)
    if problem is not None:
        raise invalid(problem)
    return text


def validation_error(model: type[BaseModel], error: ValidationError) -> ApiError:
    """pydantic's errors as one ApiError: one `field: what` part per error."""
    details = error.errors(include_url=False)
    parts = [_describe(model, detail) for detail in details[:MAX_ERROR_PARTS]]
    if len(details) > MAX_ERROR_PARTS:
        parts.append(f"and {len(details) - MAX_ERROR_PARTS} more")
    is_unsupported = any(d["type"] in UNSUPPORTED_ERROR_TYPES for d in details)
    code = "unsupported_parameter" if is_unsupported else "invalid_value"
    param = _field_path(details[0]["loc"]) if details else None
    return ApiError(400, "; ".join(parts), code=code, param=param or None)


def _describe(model: type[BaseModel], detail: Any) -> str:
    path = _field_path(detail["loc"]) or "request body"
    if detail["type"] == "extra_forbidden":
        known = ", ".join(model.model_fields) if len(detail["loc"]) == 1 else None
        hint = f" (known fields: {known})" if known else ""
        return f"{path}: unknown field; this server refuses fields it does not implement{hint}"
    message = str(detail["msg"])
    if detail["type"] == "missing":
        return f"{path}: required"
    shown = repr(detail.get("input"))
    if len(shown) > _INPUT_SHOWN_CHARS:
        shown = shown[: _INPUT_SHOWN_CHARS - 3] + "..."
    return f"{path}: {message[:1].lower()}{message[1:]} (got {shown})"


def _field_path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path
