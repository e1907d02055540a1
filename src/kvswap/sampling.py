"""The sampling rule: every sampling parameter's allowed range, defined once.

The HTTP request models, `kvswap generate`, `kvswap run` and the engine all check
a value against the functions here, so a value the edge accepts is a value the
sampler can use (a request can never reach the engine thread with a seed the
generator refuses or a temperature that overflows the logits). Each check
returns the problem as text ("allowed: ...") or None; callers turn it into a 400,
an exit 2 or an exception, in their own words for the field's name.

    temperature   0 (greedy) or a number in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    top_p         a number in (0, 1]; the most likely token is always kept
    top_k         an integer >= 1
    seed          an integer in 0..MAX_SEED

Torch-free and standard library only, so the HTTP layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswap.errors import KvSwapError

#: The largest sampling seed: a torch generator takes a signed 64-bit seed, and the
#: engine derives per-token seeds masked to 63 bits, so one range serves both.
MAX_SEED = 2**63 - 1
#: The smallest positive temperature: logits of a few hundred divided by less would
#: overflow float32; a vanishing temperature means greedy decoding, which is 0.
MIN_TEMPERATURE = 1e-3
#: The largest temperature, as in the OpenAI API (flatter than this is noise).
MAX_TEMPERATURE = 2.0


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
