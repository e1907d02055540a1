"""The sampling rule: every sampling parameter's allowed range, defined once.

The HTTP request models, `kvswap generate`, `kvswap run` and the engine all check
a value against the functions here, so a value the edge accepts is a value the
sampler can use (a request can never reach the engine thread with a seed the
generator refuses or a temperature that overflows the logits). Each check
returns the problem as text ("allowed: ...") or None; callers turn it into a 400,
an exit 2 or an exception, in their own words for the field's name.

    temperature         0 (greedy) or a number in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    top_p               a number in (0, 1]; the most likely token is always kept
    top_k               an integer >= 1 (the API's -1 and 0 mean none: `api_top_k`)
    seed                an integer in 0..MAX_SEED
    presence_penalty    a number in [-2, 2] (0: off), as in the OpenAI API
    frequency_penalty   a number in [-2, 2] (0: off), as in the OpenAI API
    repetition_penalty  a number in [0.01, 100] (1: off), vLLM's (which takes any > 0)
    logit_bias          token id -> a number in [-100, 100], as in the OpenAI API
    min_tokens          an integer >= 0 (no stop token before that many)
    logprobs            an integer in 0..MAX_LOGPROBS: the top alternatives per token

Two records carry a request's sampling to the sampler: `SamplingParams`, the draw
(None: greedy), and `LogitsOptions`, what is done to the logits before it and
what is reported back (None: nothing). The seeds every drawn token uses are
derived here too (`token_seed`, `choice_seed`), from the request's seed and the
token's position alone: never from an id the server assigns, so the same request
draws the same tokens whatever batch, step or order it runs in.

Torch-free and standard library only, so the HTTP layer may import it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvswap.errors import KvSwapError

#: The largest sampling seed: a torch generator takes a signed 64-bit seed, and the
#: engine derives per-token seeds masked to 63 bits, so one range serves both.
MAX_SEED = 2**63 - 1
#: The smallest positive temperature: logits of a few hundred divided by less would
#: overflow float32; a vanishing temperature means greedy decoding, which is 0.
MIN_TEMPERATURE = 1e-3
#: The largest temperature, as in the OpenAI API (flatter than this is noise).
MAX_TEMPERATURE = 2.0
#: The top_k values of vLLM's API that mean "no top-k" (None here).
API_TOP_K_OFF = frozenset({-1, 0})
#: presence_penalty and frequency_penalty: the OpenAI API's range.
MAX_ABS_PENALTY = 2.0
#: repetition_penalty divides a seen token's positive logit and multiplies a negative
#: one: past these bounds it already makes a seen token certain or impossible, and a
#: vanishing one would overflow float32 logits (vLLM takes any value > 0).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
#: logit_bias values: the OpenAI API's range (vLLM clamps to it; this server refuses).
MAX_ABS_LOGIT_BIAS = 100.0
#: The most alternatives a token's logprobs may list: OpenAI's top_logprobs limit and
#: vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
#: A log-probability of a token the draw cannot pick (-inf) is reported as this, as the
#: OpenAI API and vLLM write it (JSON has no -inf).
MIN_LOGPROB = -9999.0


def _number(value: object) -> float | None:
    """`value` as a number, or None for anything else (a bool is not a number here)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return None


def temperature_problem(value: object) -> str | None:
    """Why `value` is no temperature, or None (0 is greedy)."""
    allowed = f"allowed: 0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"
    number = _number(value)
    if number is not None and (number == 0 or MIN_TEMPERATURE <= number <= MAX_TEMPERATURE):
        return None  # NaN fails both comparisons
    return allowed


def top_p_problem(value: object) -> str | None:
    number = _number(value)
    if number is not None and 0 < number <= 1:
        return None
    return "allowed: a number in (0, 1]"


def top_k_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return "allowed: an integer >= 1"


def api_top_k(value: int) -> int | None:
    """vLLM's `top_k` as this server takes it: -1 and 0 mean no top-k (None); any other
    value is itself (checked with `api_top_k_problem` first)."""
    return None if value in API_TOP_K_OFF else value


def api_top_k_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= -1:
        return None
    return "allowed: -1 or 0 (no top-k), or an integer >= 1"


def seed_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED:
        return None
    return f"allowed: an integer in 0..{MAX_SEED} (2**63-1)"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def sampling_problems(
    temperature: object, seed: object, top_p: object = 1.0, top_k: object = None
) -> list[str]:
    """One `name = value: allowed ...` line per value outside the rule (`top_k` None:
    no top-k)."""
    checks = [
        ("temperature", temperature, temperature_problem(temperature)),
        ("top_p", top_p, top_p_problem(top_p)),
        ("seed", seed, seed_problem(seed)),
    ]
    if top_k is not None:
        checks.append(("top_k", top_k, top_k_problem(top_k)))
    return [f"{name} = {_shown(value)}: {problem}" for name, value, problem in checks if problem]


@dataclass(frozen=True)
class SamplingParams:
    """Seeded sampling at a positive temperature; greedy decoding is `None` wherever a
    `SamplingParams | None` is taken (see `sampling_or_greedy`)."""

    temperature: float
    seed: int
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        problems = sampling_problems(self.temperature, self.seed, self.top_p, self.top_k)
        if problems:
            raise KvSwapError(problems[0])
        if self.temperature == 0:
            raise KvSwapError(
                "temperature = 0 means greedy decoding: pass no SamplingParams "
                "(sampling_or_greedy does this)"
            )


def sampling_or_greedy(
    temperature: float | None, seed: int, top_p: float = 1.0, top_k: int | None = None
) -> SamplingParams | None:
    """The sampling for these values, or None (greedy) when `temperature` is None or 0.
    Every value is checked either way: a one-line KvSwapError names the first that is
    outside the rule."""
    problems = sampling_problems(0 if temperature is None else temperature, seed, top_p, top_k)
    if problems:
        raise KvSwapError(problems[0])
    if not temperature:
        return None
    return SamplingParams(temperature=temperature, seed=seed, top_p=top_p, top_k=top_k)


def _number_in(value: object, low: float, high: float) -> bool:
    number = _number(value)
    return number is not None and low <= number <= high  # NaN fails the comparison


def penalty_problem(value: object) -> str | None:
    """presence_penalty and frequency_penalty."""
    if _number_in(value, -MAX_ABS_PENALTY, MAX_ABS_PENALTY):
        return None
    return f"allowed: a number in [{-MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] (0: off)"


def repetition_penalty_problem(value: object) -> str | None:
    if _number_in(value, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        return None
    return f"allowed: a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off)"


def logit_bias_problem(value: object) -> str | None:
    """One bias value."""
    if _number_in(value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS):
        return None
    return f"allowed: a number in [{-MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"


def min_tokens_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return None
    return "allowed: an integer >= 0"


def num_logprobs_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS:
        return None
    return f"allowed: an integer in 0..{MAX_LOGPROBS}"


@dataclass(frozen=True)
class LogitsOptions:
    """What a request does to its logits before the draw, and what it asks back; None
    wherever a `LogitsOptions | None` is taken means none of it (`logits_options_or_none`).

    In the sampler's order (vLLM's): stop tokens are impossible until `min_tokens`
    tokens were generated; `logit_bias` is added; `repetition_penalty` divides the
    positive logits and multiplies the negative ones of every token seen in the prompt
    or the output; `frequency_penalty` times a token's count in the output and
    `presence_penalty` once if it occurs there are subtracted (the OpenAI API's
    definition). Then the draw (`SamplingParams`, or greedy). `num_logprobs` (None:
    none) asks for the sampled token's log-probability and the `num_logprobs` most
    likely tokens', from the distribution the draw used.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct, sorted
    min_tokens: int = 0
    num_logprobs: int | None = None

    def __post_init__(self) -> None:
        problems = options_problems(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
            dict(self.logit_bias), self.min_tokens, self.num_logprobs,
        )  # fmt: skip
        if problems:
            raise KvSwapError(problems[0])
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise KvSwapError("logit_bias: token ids must be distinct and sorted")

    @property
    def penalizes(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (
            0.0, 0.0, 1.0,
        )  # fmt: skip


def options_problems(
    presence_penalty: object = 0.0,
    frequency_penalty: object = 0.0,
    repetition_penalty: object = 1.0,
    logit_bias: Mapping[int, float] | Mapping[object, object] | None = None,
    min_tokens: object = 0,
    num_logprobs: object = None,
) -> list[str]:
    """One `name = value: allowed ...` line per value outside the rule."""
    checks = [
        ("presence_penalty", presence_penalty, penalty_problem(presence_penalty)),
        ("frequency_penalty", frequency_penalty, penalty_problem(frequency_penalty)),
        ("repetition_penalty", repetition_penalty, repetition_penalty_problem(repetition_penalty)),
        ("min_tokens", min_tokens, min_tokens_problem(min_tokens)),
    ]
    if num_logprobs is not None:
        checks.append(("logprobs", num_logprobs, num_logprobs_problem(num_logprobs)))
    for token, bias in (logit_bias or {}).items():
        if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
            checks.append(("logit_bias key", token, "allowed: a token id (an integer >= 0)"))
        problem = logit_bias_problem(bias)
        if problem is not None:
            checks.append((f"logit_bias[{token}]", bias, problem))
    return [f"{name} = {_shown(value)}: {problem}" for name, value, problem in checks if problem]


def logits_options_or_none(
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    num_logprobs: int | None = None,
) -> LogitsOptions | None:
    """The options for these values, or None when every one is neutral (a plain request
    samples exactly as before options existed). A one-line KvSwapError names the first
    value outside the rule."""
    problems = options_problems(
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
        min_tokens, num_logprobs,
    )  # fmt: skip
    if problems:
        raise KvSwapError(problems[0])
    biases = tuple(sorted((token, float(bias)) for token, bias in (logit_bias or {}).items()))
    options = LogitsOptions(
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        logit_bias=biases,
        min_tokens=min_tokens,
        num_logprobs=num_logprobs,
    )
    return None if options == LogitsOptions() else options


@dataclass(frozen=True)
class LogitsContext:
    """What the sampler needs beside a sequence's logits to apply its `LogitsOptions`:
    the request's prompt and the tokens it generated so far (the penalties' history and
    `min_tokens`' count), and the tokens `min_tokens` holds back."""

    options: LogitsOptions
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the `num_logprobs` most likely tokens'
    (token id, log-probability), most likely first; -inf is written as MIN_LOGPROB."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# -- seeds -------------------------------------------------------------------------------


def _mix(*values: int) -> int:
    """A 63-bit seed from non-negative integers < 2**64 (blake2b: the same on every
    machine and Python version, unlike `hash`)."""
    data = b"".join(value.to_bytes(8, "little") for value in values)
    digest = hashlib.blake2b(data, digest_size=8, person=b"kvswap-seed").digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def token_seed(seed: int, position: int) -> int:
    """The seed of the generator that draws the token at `position` (its index in the
    sequence, prompt included) for a request seeded with `seed`. A function of these two
    alone: the same request draws the same tokens in any batch, step or order, whatever
    sequence id the server gives it."""
    return _mix(seed, position)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n` choices: choice 0 is the
    request's own seed (so `n = 1` and the first of `n` agree), the others are derived."""
    return seed if index == 0 else _mix(seed, index, 1)


def workload_request_seed(seed: int, request_id: int) -> int:
    """The seed of request `request_id` of a workload run with one seed (`kvswap run
    --temperature T --seed S`): each request draws its own tokens, reproducibly."""
    return _mix(seed, request_id, 2)


def floored_logprob(value: float) -> float:
    """A log-probability as the API writes it: -inf (and NaN) as MIN_LOGPROB."""
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB
