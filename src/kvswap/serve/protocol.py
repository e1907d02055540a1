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
each part naming its field (kvswap.serve.body_errors). Text (a prompt, a message, a
cache salt) must be valid Unicode: a lone surrogate escape ("\\ud800") is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kvswap.base.identity import MAX_CACHE_SALT_CHARS
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
from kvswap.serve.body_errors import invalid, unsupported, valid_text, validation_error
from kvswap.serve.chat_message import ChatMessage, StrictBody
from kvswap.serve.detokenize import MAX_STOP_STRINGS  # the OpenAI API's limit
from kvswap.serve.errors import ApiError

#: The most choices one request may ask for (`n`), as in the OpenAI API.
MAX_CHOICES = 128
#: Completions generate this many tokens when `max_tokens` is absent (OpenAI, vLLM);
#: chat generates to the end of the context.
DEFAULT_COMPLETION_TOKENS = 16
#: logit_bias ids are below this where the vocabulary is unknown (no tokenizer, no model).
MAX_TOKEN_ID_BOUND = 2**31
_SAMPLING_RULE = {
    "temperature": temperature_problem,
    "top_p": top_p_problem,
    "seed": seed_problem,
    "presence_penalty": penalty_problem,
    "frequency_penalty": penalty_problem,
    "repetition_penalty": repetition_penalty_problem,
    "min_tokens": min_tokens_problem,
}

Model = TypeVar("Model", bound=BaseModel)


def _token_ids(value: Any) -> tuple[int, ...] | None:
    """`value` as token ids if it is a list of non-negative ints (bools excluded)."""
    if isinstance(value, list) and all(type(x) is int and x >= 0 for x in value):
        return tuple(value)
    return None


def _bias_token_id(key: str, vocab_size: int) -> int:
    """The token id a logit_bias key of decimal digits names, if below `vocab_size`. Its
    length is checked first: int() refuses strings past 4,300 digits, with its own words."""
    digits = key.lstrip("0") or "0"
    if len(digits) > len(str(vocab_size)) or int(digits) >= vocab_size:
        shown = digits if len(digits) <= 20 else f"{digits[:12]}... ({len(digits)} digits)"
        raise invalid(f"token id {shown} is outside the vocabulary (0..{vocab_size - 1})")
    return int(digits)


class StreamOptions(StrictBody):
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


class _Sampling(StrictBody):
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
    cache_salt: str | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("expected a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"{len(stops)} stop strings; allowed: at most {MAX_STOP_STRINGS}")
        return tuple(stops)

    @field_validator(*_SAMPLING_RULE, mode="after")
    @classmethod
    def _sampling_rule(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        problem = _SAMPLING_RULE[str(info.field_name)](value)
        if problem is not None:
            raise invalid(problem)
        return value

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        problem = None if value is None else api_top_k_problem(value)
        if problem is not None:
            raise invalid(problem)
        return value

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _logit_bias(cls, value: Any, info: ValidationInfo) -> dict[int, float] | None:
        """{"token id": bias}: JSON keys are strings of decimal token ids, each in the
        vocabulary (parse_body's `vocab_size`; unknown: below MAX_TOKEN_ID_BOUND)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid('expected an object mapping token ids to biases, {"50256": -100}')
        vocab_size = (info.context or {}).get("vocab_size") or MAX_TOKEN_ID_BOUND
        biases: dict[int, float] = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise invalid(f"key {key!r}: expected a token id (a decimal integer >= 0)")
            problem = logit_bias_problem(bias)
            if problem is not None:
                raise invalid(f"[{key}] = {bias!r}: {problem}")
            biases[_bias_token_id(key, vocab_size)] = float(bias)
        return biases

    @field_validator("cache_salt", mode="after")
    @classmethod
    def _cache_salt(cls, value: str | None) -> str | None:
        """The engine's rule (kvswap.base.identity), checked here: a salt it refuses
        must never reach its thread."""
        if value is None:
            return None
        if not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
            raise invalid(f"{len(value)} characters; allowed: 1 to {MAX_CACHE_SALT_CHARS}")
        return valid_text(value)

    @field_validator("n", mode="after")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise invalid(f"allowed: an integer in 1..{MAX_CHOICES}")
        return value

    @field_validator("response_format", mode="after")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None or value == {"type": "text"}:
            return value
        kind = value.get("type")
        if kind in ("json_object", "json_schema", "structural_tag"):
            raise unsupported(
                f"type {kind!r}: structured output is not supported by this server; "
                'allowed: {"type": "text"}'
            )
        raise invalid('allowed: {"type": "text"}, nothing else')

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
    def logprobs_field(self) -> str:
        """The field `num_logprobs` came from, for messages."""
        return "logprobs"

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
            return valid_text(value)
        ids = _token_ids(value)
        if ids is not None:
            return ids
        if (
            isinstance(value, list)
            and len(value) > 1
            and all(isinstance(v, str) or _token_ids(v) is not None for v in value)
        ):
            raise unsupported(f"a batch of {len(value)} prompts; send one prompt per request")
        raise invalid(
            "expected a string, a list of one string, a list of token ids (ints >= 0) "
            "or a list of one list of token ids"
        )

    @field_validator("logprobs", mode="after")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        problem = None if value is None else num_logprobs_problem(value)
        if problem is not None:
            raise invalid(problem)
        return value

    @field_validator("echo", mode="after")
    @classmethod
    def _echo(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("the prompt is not repeated in the answer here; leave it false")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def default_max_tokens(self) -> int | None:
        return DEFAULT_COMPLETION_TOKENS


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
            raise invalid(problem)
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise unsupported(
                f"{len(value)} given; this server does not call tools; send none, or []"
            )
        return value

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is None or value == "none":
            return value
        shown = repr(value) if isinstance(value, str) else "a named tool"
        raise unsupported(f"{shown} asks for a tool call, which this server never makes; "
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
    def logprobs_field(self) -> str:
        return "top_logprobs"

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) when given, else `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def parse_body(model: type[Model], body: bytes, *, vocab_size: int | None = None) -> Model:
    """The body as `model`, or an ApiError (400) for what cannot be read, is not supported,
    or holds a value of the wrong type or range; one line naming every field. Token ids
    in `logit_bias` are checked against `vocab_size` (None: unknown)."""
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
        parsed = model.model_validate(value, context={"vocab_size": vocab_size})
    except ValidationError as error:
        raise validation_error(model, error) from None
    if isinstance(parsed, _Sampling):
        parsed._check_combinations()
    return parsed
