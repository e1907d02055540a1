"""Seeded synthetic workloads: multi-turn sessions over shared system prompts.

Each session picks one of `num_system_prompts` system prompts (an identical
token prefix across the sessions that share it, so prefix caching and sink
protection have something to find), sends a first prompt, then
`turns_per_session - 1` follow-ups, each after an exponential think time.
Sessions start as a Poisson process (exponential gaps, the first at t = 0);
an infinite rate starts them all at t = 0.

Every random stream is keyed by (seed, purpose, session), never global state:
session i is the same whatever `num_sessions` is, and the same seed gives the
same workload on every run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvswap.errors import ConfigError
from kvswap.workload.bounds import (
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    WorkloadBill,
    check_bill,
    check_count,
)
from kvswap.workload.request import FollowUp, Request, Workload
from kvswap.workload.tokens import random_token_ids, seeded_rng


@dataclass(frozen=True)
class SyntheticSpec:
    """What to generate. Validated on construction; lengths in tokens.

    `prompt_tokens` is the whole first-turn prompt, system prompt included;
    `length_jitter` = j draws every length uniformly from n * [1 - j, 1 + j]
    (0 = exact lengths).
    """

    num_sessions: int = 8
    turns_per_session: int = 1
    prompt_tokens: int = 512
    output_tokens: int = 128
    user_tokens_per_turn: int = 64
    system_prompt_tokens: int = 0
    num_system_prompts: int = 1
    arrival_rate_per_s: float = math.inf
    think_time_s: float = 0.0
    length_jitter: float = 0.0
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_sessions",
            "turns_per_session",
            "prompt_tokens",
            "output_tokens",
            "user_tokens_per_turn",
            "num_system_prompts",
            "vocab_size",
        ):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("system_prompt_tokens", self.system_prompt_tokens, minimum=0)
        _check_int("seed", self.seed, minimum=None)
        if self.system_prompt_tokens > self.prompt_tokens:
            raise ConfigError(
                f"system_prompt_tokens = {self.system_prompt_tokens}: the first prompt holds "
                f"prompt_tokens = {self.prompt_tokens} tokens, system prompt included; "
                f"allowed: 0..{self.prompt_tokens}"
            )
        rate = _check_number("arrival_rate_per_s", self.arrival_rate_per_s, allow_inf=True)
        if rate <= 0:
            raise ConfigError(
                f"arrival_rate_per_s = {rate!r}: allowed: > 0 requests per second "
                "(inf = all sessions at t = 0)"
            )
        think = _check_number("think_time_s", self.think_time_s, allow_inf=False)
        if think < 0:
            raise ConfigError(f"think_time_s = {think!r}: allowed: >= 0 seconds")
        jitter = _check_number("length_jitter", self.length_jitter, allow_inf=False)
        if not 0 <= jitter <= 1:
            raise ConfigError(f"length_jitter = {jitter!r}: allowed: 0..1")
        # Each field on its own first, so the error names the field; the whole
        # bill (`bill()`) is checked by `generate_synthetic`.
        for name in ("num_sessions", "turns_per_session", "num_system_prompts"):
            check_count(name, getattr(self, name), MAX_REQUESTS, "MAX_REQUESTS")
        for name in ("prompt_tokens", "output_tokens", "user_tokens_per_turn"):
            check_count(name, getattr(self, name), MAX_REQUEST_TOKENS, "MAX_REQUEST_TOKENS")

    def bill(self) -> WorkloadBill:
        """The workload's cost at the longest lengths the jitter allows; its duration is
        the expected span of the session starts and think times."""
        stretch = 1.0 + self.length_jitter
        system = self.system_prompt_tokens
        first = system + math.ceil((self.prompt_tokens - system) * stretch)
        output = math.ceil(self.output_tokens * stretch)
        user = math.ceil(self.user_tokens_per_turn * stretch)
        turns, sessions = self.turns_per_session, self.num_sessions
        # Turn k's resolved prompt is the first prompt plus k earlier (output + user).
        growth = output + user
        held_per_session = turns * (first + output) + growth * turns * (turns - 1) // 2
        new_per_session = first + turns * output + (turns - 1) * user
        rate = self.arrival_rate_per_s
        starts_s = 0.0 if math.isinf(rate) else (sessions - 1) / rate
        return WorkloadBill(
            num_requests=sessions * turns,
            longest_request_tokens=first + (turns - 1) * growth + output,
            held_tokens=sessions * held_per_session,
            new_tokens=sessions * new_per_session + self.num_system_prompts * system,
            duration_s=starts_s + (turns - 1) * self.think_time_s,
        )


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    allowed = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} = {value!r}: allowed: {allowed}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} = {value!r}: allowed: {allowed}")


def _check_number(name: str, value: object, *, allow_inf: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} = {value!r}: allowed: a number")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ConfigError(f"{name} = {value!r}: allowed: a finite number")
    return number


def jittered(rng: random.Random, base_tokens: int, jitter: float, minimum: int) -> int:
    """`base_tokens` times a uniform factor in 1 +- `jitter`, at least `minimum`."""
    # Always draw, so changing the jitter does not shift the rest of the stream.
    factor = rng.uniform(1.0 - jitter, 1.0 + jitter)
    return max(minimum, round(base_tokens * factor))


@dataclass(frozen=True)
class DraftTurn:
    """A request before ids are known (ids follow arrival order, `in_arrival_order`)."""

    arrival_s: float
    turn: int
    session_id: int
    user_ids: tuple[int, ...]  # turn 0: system prompt + first user message
    max_new_tokens: int
    think_time_s: float


def _session_turns(
    spec: SyntheticSpec, session_id: int, start_s: float, system_prompts: list[tuple[int, ...]]
) -> list[DraftTurn]:
    shape_rng = seeded_rng("synthetic", spec.seed, "shape", session_id)
    token_rng = seeded_rng("synthetic", spec.seed, "tokens", session_id)
    system_ids = system_prompts[shape_rng.randrange(spec.num_system_prompts)]
    first_user_tokens = jittered(
        shape_rng,
        spec.prompt_tokens - spec.system_prompt_tokens,
        spec.length_jitter,
        minimum=0 if system_ids else 1,
    )
    turns: list[DraftTurn] = []
    arrival_s = start_s
    for turn in range(spec.turns_per_session):
        if turn == 0:
            user_ids = system_ids + random_token_ids(token_rng, first_user_tokens, spec.vocab_size)
            think_s = 0.0
        else:
            think_s = shape_rng.expovariate(1.0 / spec.think_time_s) if spec.think_time_s else 0.0
            num_user_tokens = jittered(
                shape_rng, spec.user_tokens_per_turn, spec.length_jitter, minimum=1
            )
            user_ids = random_token_ids(token_rng, num_user_tokens, spec.vocab_size)
            arrival_s += think_s  # earliest arrival: as if the previous turn took no time
        max_new_tokens = jittered(shape_rng, spec.output_tokens, spec.length_jitter, minimum=1)
        turns.append(DraftTurn(arrival_s, turn, session_id, user_ids, max_new_tokens, think_s))
    return turns


def _session_starts(spec: SyntheticSpec) -> list[float]:
    if math.isinf(spec.arrival_rate_per_s):
        return [0.0] * spec.num_sessions
    rng = seeded_rng("synthetic", spec.seed, "arrivals")
    starts = [0.0]
    for _ in range(spec.num_sessions - 1):
        starts.append(starts[-1] + rng.expovariate(spec.arrival_rate_per_s))
    return starts


def generate_synthetic(spec: SyntheticSpec) -> Workload:
    """Build the workload `spec` describes (deterministic in `spec`); its bill is
    checked against the bounds (`bounds.check_bill`) before anything is drawn."""
    check_bill(spec.bill(), "synthetic workload")
    system_prompts = [
        random_token_ids(
            seeded_rng("synthetic", spec.seed, "system", index),
            spec.system_prompt_tokens,
            spec.vocab_size,
        )
        for index in range(spec.num_system_prompts)
    ]
    drafts: list[DraftTurn] = []
    for session_id, start_s in enumerate(_session_starts(spec)):
        drafts.extend(_session_turns(spec, session_id, start_s, system_prompts))
    requests = in_arrival_order(drafts)
    name = (
        f"synthetic(sessions={spec.num_sessions}, turns={spec.turns_per_session}, seed={spec.seed})"
    )
    return Workload(requests=requests, name=name, vocab_size=spec.vocab_size)


def in_arrival_order(drafts: list[DraftTurn]) -> tuple[Request, ...]:
    """The drafts of many sessions as requests, ids in arrival order, each later turn a
    follow-up of its session's turn before it."""
    # Ties: first turns before later turns, then by session. A turn never
    # sorts before its predecessor: earlier-or-equal arrival and a lower turn.
    ordered = sorted(drafts, key=lambda draft: (draft.arrival_s, draft.turn, draft.session_id))
    request_ids = {(d.session_id, d.turn): index for index, d in enumerate(ordered)}
    requests = []
    for index, draft in enumerate(ordered):
        follow_up = None
        if draft.turn > 0:
            follow_up = FollowUp(
                previous_request_id=request_ids[(draft.session_id, draft.turn - 1)],
                new_user_ids=draft.user_ids,
                think_time_s=draft.think_time_s,
            )
        requests.append(
            Request(
                request_id=index,
                arrival_s=draft.arrival_s,
                prompt_ids=() if follow_up is not None else draft.user_ids,
                max_new_tokens=draft.max_new_tokens,
                session_id=draft.session_id,
                turn=draft.turn,
                follow_up=follow_up,
            )
        )
    return tuple(requests)
