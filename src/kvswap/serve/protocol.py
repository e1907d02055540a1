"""The request bodies of /v1/completions and /v1/chat/completions, validated by pydantic.

Field names follow the OpenAI API, plus vLLM's where users meet both servers:
`top_k`, `min_tokens`, `repetition_penalty`, `cache_salt` (per-tenant prefix-cache
isolation) and `ignore_eos` (fixed output lengths for benchmarks); chat takes
`max_completion_tokens` and `max_tokens`. `user` is accepted and not used. Every
field, its values and where this server differs: docs/api_fields.md.

Fields for what this server does not do are accepted at their neutral value only
(`tools: []`, `tool_choice: "none"`, `response_format: {"type": "text"}`, `echo:
false`) and otherwise refused by name. Unknown fields are refused (400, naming the
field), where vLLM ignores them with a warning: an option this server does not
implement (`best_of`, `min_p`, ...) would otherwise change nothing while the client
believes it applied. Types are strict: `"5"` is not a number, `true` is not 1.
Everything a body can get wrong is reported at once, one line, `; `-separated,
each part naming its field (400, as the OpenAI API and vLLM answer; see kvswap.serve.errors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
from kvswap.sampling import (
    api_top_k,
    api_top_k_problem,
    logit_bias_problem,
    min_tokens_problem,
    num_logprobs_problem,
    penalty_problem,
    repetition_penalty_problem,
    seed_problem,
    temperature_problem,
    top_p_problem,
)
from kvswap.serve.detokenize import MAX_STOP_STRINGS  # the OpenAI API's limit
from kvswap.serve.errors import ApiError

#: Error types that mean "this server does not do that"; every other is a bad value.
UNSUPPORTED_ERROR_TYPES = frozenset({"extra_forbidden", "unsupported"})
#: How the text parts of one message's content are joined (as vLLM and chat_template join).
CONTENT_PART_SEPARATOR = "\n"
#: Problems named in one error message; the rest are counted ("and N more"), so 100,000
#: bad chat messages cost one short line, not megabytes.
MAX_ERROR_PARTS = 5
#: The most choices one request may ask for (`n`), as in the OpenAI API.
MAX_CHOICES = 128
#: Completions generate this many tokens when `max_tokens` is absent (OpenAI, vLLM);
#: chat generates to the end of the context.
DEFAULT_COMPLETION_TOKENS = 16
#: The chat roles a text model takes (OpenAI's, less `tool` and `function`, which
#: answer tool calls this server never makes).
CHAT_ROLES = ("system", "developer", "user", "assistant")
_SAMPLING_RULE = {
    "temperature": temperature_problem,
    "top_p": top_p_problem,
    "seed": seed_problem,
    "presence_penalty": penalty_problem,
    "frequency_penalty": penalty_problem,
    "repetition_penalty": repetition_penalty_problem,
    "min_tokens": min_tokens_problem,
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


@dataclass(frozen=True)
class RequestSampling:
    """A body's sampling, translated from the API's forms (`top_k` -1/0 is None, the
    absent `max_tokens` the endpoint's default) and checked against the rule."""

    max_tokens: int | None  # None: the endpoint's default
    default_max_tokens: int | None  # None: the rest of the context
    temperature: float | None
    top_p: float | None
    seed: int | None
    cache_salt: str | None
    n: int = 1
    top_k: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    num_logprobs: int | None = None  # None: no logprobs


class _Sampling(_Body):
    """The fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # Ranges: kvswap.sampling, the one rule the engine checks too.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None

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

    @field_validator(*_SAMPLING_RULE, mode="after")
    @classmethod
    def _sampling_rule(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        problem = _SAMPLING_RULE[str(info.field_name)](value)
        if problem is not None:
            raise _invalid(problem)
        return value

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        problem = None if value is None else api_top_k_problem(value)
        if problem is not None:
            raise _invalid(problem)
        return value

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        """{"token id": bias}: JSON keys are strings of decimal token ids."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise _invalid('expected an object mapping token ids to biases, {"50256": -100}')
        biases: dict[int, float] = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise _invalid(f"key {key!r}: expected a token id (a decimal integer >= 0)")
            problem = logit_bias_problem(bias)
            if problem is not None:
                raise _invalid(f"[{key}] = {bias!r}: {problem}")
            biases[int(key)] = float(bias)
        return biases

    @field_validator("n", mode="after")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise _invalid(f"allowed: an integer in 1..{MAX_CHOICES}")
        return value

    @field_validator("response_format", mode="after")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None or value == {"type": "text"}:
            return value
        kind = value.get("type")
        if kind in ("json_object", "json_schema", "structural_tag"):
            raise _unsupported(
                f"type {kind!r}: structured output is not supported by this server; "
                'allowed: {"type": "text"}'
            )
        raise _invalid('allowed: {"type": "text"}, nothing else')

    def sampling(self) -> RequestSampling:
        """The body's sampling as the generation is planned with."""
        return RequestSampling(
            max_tokens=self.requested_max_tokens,
            default_max_tokens=self.default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            cache_salt=self.cache_salt,
            n=self.n or 1,
            top_k=None if self.top_k is None else api_top_k(self.top_k),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=self.logit_bias or {},
            num_logprobs=self.num_logprobs,
        )

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token asked for; None: no logprobs."""
        return None

    @property
    def default_max_tokens(self) -> int | None:
        """Tokens to generate without `max_tokens`; None: the rest of the context."""
        return None

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

    def _check_combinations(self) -> None:
        """Rules between fields, after each field passed its own (one ApiError)."""
        if self.stream_options is not None and not self.streaming:
            raise ApiError(
                400, "stream_options: allowed only with stream = true",
                code="invalid_value", param="stream_options",
            )  # fmt: skip


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt` becomes a string or a tuple of token ids."""

    prompt: str | tuple[int, ...]
    logprobs: int | None = None
    echo: bool | None = None

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
        problem = None if value is None else num_logprobs_problem(value)
        if problem is not None:
            raise _invalid(problem)
        return value

    @field_validator("echo", mode="after")
    @classmethod
    def _echo(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("the prompt is not repeated in the answer here; leave it false")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def default_max_tokens(self) -> int | None:
        return DEFAULT_COMPLETION_TOKENS


class ChatMessage(_Body):
    """One chat turn: `role` (one of CHAT_ROLES), `content` (a string or text parts,
    joined with a newline as vLLM joins them), `name`. Fields whose value is null are
    dropped first, as transformers drops them (clients echo `"tool_calls": null` back in
    assistant turns); `content` is then required, as the OpenAI API requires it of every
    message without tool calls."""

    role: str
    content: str
    name: str | None = None

    @field_validator("role", mode="after")
    @classmethod
    def _role(cls, value: str) -> str:
        if value in CHAT_ROLES:
            return value
        if value in ("tool", "function"):
            raise _unsupported(
                f"{value!r} messages answer tool calls, which this server never makes"
            )
        raise _invalid(f"allowed: {', '.join(CHAT_ROLES)}")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if item is not None}
        return value

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str:
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
        """The message as a chat template reads it."""
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        problem = None if value is None else num_logprobs_problem(value)
        if problem is not None:
            raise _invalid(problem)
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise _unsupported(
                f"{len(value)} given; this server does not call tools; send none, or []"
            )
        return value

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is None or value == "none":
            return value
        shown = repr(value) if isinstance(value, str) else "a named tool"
        raise _unsupported(f"{shown} asks for a tool call, which this server never makes; "
                           "allowed: 'none'")  # fmt: skip

    def _check_combinations(self) -> None:
        super()._check_combinations()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(
                400, "top_logprobs: allowed only with logprobs = true (as in the OpenAI API)",
                code="invalid_value", param="top_logprobs",
            )  # fmt: skip

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
        parsed._check_combinations()
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
