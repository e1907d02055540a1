"""The request bodies of /v1/completions and /v1/chat/completions, validated by pydantic.

Field names follow the OpenAI API, plus two of vLLM's where users meet both
servers: `cache_salt` (per-tenant prefix-cache isolation) and `ignore_eos` (fixed
output lengths for benchmarks); chat takes `max_completion_tokens` and `max_tokens`.
`user` is accepted and not used.

Unknown fields are refused (400, naming the field), where vLLM ignores them with a
warning: a sampling option this server does not implement (`presence_penalty`,
`best_of`, `logit_bias`, ...) would otherwise change nothing while the client
believes it applied. Types are strict: `"5"` is not a number, `true` is not 1.
Everything a body can get wrong is reported at once, one line, `; `-separated,
each part naming its field (400, as the OpenAI API and vLLM answer; see kvswap.serve.errors).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvswap.errors import KvSwapError
from kvswap.readers import parse_json
from kvswap.sampling import seed_problem, temperature_problem, top_p_problem
from kvswap.serve.detokenize import MAX_STOP_STRINGS  # the OpenAI API's limit
from kvswap.serve.errors import ApiError

#: Error types that mean "this server does not do that"; every other is a bad value.
UNSUPPORTED_ERROR_TYPES = frozenset({"extra_forbidden", "unsupported"})
#: How the text parts of one message's content are joined (as vLLM and chat_template join).
CONTENT_PART_SEPARATOR = "\n"
#: Problems named in one error message; the rest are counted ("and N more"), so 100,000
#: bad chat messages cost one short line, not megabytes.
MAX_ERROR_PARTS = 5
_SAMPLING_RULE = {
    "temperature": temperature_problem,
    "top_p": top_p_problem,
    "seed": seed_problem,
}
_INPUT_SHOWN_CHARS = 40

Model = TypeVar("Model", bound=BaseModel)


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def _token_ids(value: Any) -> tuple[int, ...] | None:
    """`value` as token ids if it is a list of non-negative ints (bools excluded)."""
    if isinstance(value, list) and all(type(x) is int and x >= 0 for x in value):
        return tuple(value)
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # Ranges: kvswap.sampling, the one rule the engine checks too.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    ignore_eos: bool = False

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _invalid("expected a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise _invalid(f"{len(stops)} stop strings; allowed: at most {MAX_STOP_STRINGS}")
        return tuple(stops)

    @field_validator("temperature", "top_p", "seed", mode="after")
    @classmethod
    def _sampling_rule(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        problem = _SAMPLING_RULE[str(info.field_name)](value)
        if problem is not None:
            raise _invalid(problem)
        return value

    @field_validator("n", mode="after")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported("this server returns 1 choice per request")
        return value

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` came from, for messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.streaming:
            raise ApiError(
                400, "stream_options: allowed only with stream = true",
                code="invalid_value", param="stream_options",
            )  # fmt: skip


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt` becomes a string or a tuple of token ids."""

    prompt: str | tuple[int, ...]
    logprobs: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> str | tuple[int, ...]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a batch of one: the only batch size this server takes
        if isinstance(value, str):
            return value
        ids = _token_ids(value)
        if ids is not None:
            return ids
        if (
            isinstance(value, list)
            and len(value) > 1
            and all(isinstance(v, str) or _token_ids(v) is not None for v in value)
        ):
            raise _unsupported(f"a batch of {len(value)} prompts; send one prompt per request")
        raise _invalid(
            "expected a string, a list of one string, a list of token ids (ints >= 0) "
            "or a list of one list of token ids"
        )

    @field_validator("logprobs", mode="after")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise _unsupported("logprobs are not supported by this server; leave it unset")
        return value


class ChatMessage(_Body):
    """One chat turn: `role`, `content` (a string or text parts, joined with a newline as
    vLLM joins them), `name`. Fields whose value is null are dropped first, as
    transformers drops them (clients echo `"tool_calls": null` back in assistant turns)."""

    role: str = Field(min_length=1)  # the chat template decides which roles it knows
    content: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if item is not None}
        return value

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        """A string, or a list of text parts: the only content a text model reads."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _invalid("expected a string or a list of {type: text, text} parts")
        texts: list[str] = []
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise _invalid(f"part {index}: expected {{type: text, text: string}}")
            kind = part.get("type")
            if kind is not None and kind != "text":
                raise _unsupported(f"part {index} has type {kind!r}: only text parts are read")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise _invalid(f"part {index}: expected {{type: text, text: string}}")
            texts.append(part["text"])
        return CONTENT_PART_SEPARATOR.join(texts)

    def to_template(self) -> dict[str, str]:
        """The message as a chat template reads it (null content is an empty string)."""
        message = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs", mode="after")
    @classmethod
    def _logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("logprobs are not supported by this server; leave it unset")
        return value

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value:  # 0 asks for nothing, as vLLM's default does
            raise _unsupported("top_logprobs are not supported by this server; leave it unset")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) when given, else `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def parse_body(model: type[Model], body: bytes) -> Model:
    """The body as `model`, or an ApiError (400) for what cannot be read, is not supported,
    or holds a value of the wrong type or range; one line naming every field."""
    try:
        value = parse_json(body, "request body")
    except KvSwapError as error:
        raise ApiError(400, str(error), code="invalid_json") from None
    if not isinstance(value, dict):
        raise ApiError(
            400, f"request body: expected a JSON object, got {type(value).__name__}",
            code="invalid_json",
        )  # fmt: skip
    try:
        parsed = model.model_validate(value)
    except ValidationError as error:
        raise validation_error(model, error) from None
    if isinstance(parsed, _Sampling):
        parsed._check_stream_options()
    return parsed


def validation_error(model: type[BaseModel], error: ValidationError) -> ApiError:
    """pydantic's errors as one ApiError: one `field: what` part per error."""
    details = error.errors(include_url=False)
    parts = [_describe(model, detail) for detail in details[:MAX_ERROR_PARTS]]
    if len(details) > MAX_ERROR_PARTS:
        parts.append(f"and {len(details) - MAX_ERROR_PARTS} more")
    unsupported = any(d["type"] in UNSUPPORTED_ERROR_TYPES for d in details)
    code = "unsupported_parameter" if unsupported else "invalid_value"
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
