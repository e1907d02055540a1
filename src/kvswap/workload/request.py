"""Requests and workloads: what the engine and the simulator are asked to serve.

A `Workload` is an immutable, arrival-ordered list of `Request`s. Independent
requests and the first turn of a conversation carry their whole prompt. A
later turn cannot: its prompt is the previous turn's prompt + the previous
turn's *output* + the new user message, and the output only exists at run
time. Such a turn carries a `FollowUp` instead, and the scheduler resolves its
prompt with `resolve_prompt` once the previous turn has finished:

    turn 0   prompt_ids = [sys | user0]                    (known up front)
    turn 1   prompt     = [sys | user0] + out0 + user1      (known after turn 0)
    turn 2   prompt     = turn-1 prompt + out1 + user2      (known after turn 1)

Torch-free: the simulator imports this.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvswap.base.identity import check_cache_salt
from kvswap.errors import KvSwapError


@dataclass(frozen=True)
class FollowUp:
    """How a later conversation turn extends the turn before it."""

    previous_request_id: int
    """The request whose prompt + output this turn extends (always an earlier id)."""
    new_user_ids: tuple[int, ...]
    """Token ids appended after the previous turn's output."""
    think_time_s: float
    """Delay between the previous turn FINISHING and this turn arriving."""


@dataclass(frozen=True)
class Request:
    """One generation request.

    Invariants (checked on construction):
    - a request with `follow_up` has EMPTY `prompt_ids`: its new tokens live in
      `follow_up.new_user_ids` only, so there is one source of truth for them;
    - a request without `follow_up` has a non-empty `prompt_ids`;
    - `max_new_tokens >= 1`: the engine generates exactly that many tokens
      (no early stop on EOS), so run time and KV growth are known up front.

    For a follow-up, `arrival_s` is the EARLIEST possible arrival (previous
    turn's earliest arrival + think time, as if it finished instantly); the
    scheduler computes the real one as previous finish time + `think_time_s`.
    """

    request_id: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    session_id: int | None = None
    turn: int = 0
    follow_up: FollowUp | None = None
    cache_salt: str | None = None
    """Prefix sharing scope: KV is shared only between requests with the same salt
    (None and "" share with each other, as the unsalted default)."""

    def __post_init__(self) -> None:
        try:
            check_cache_salt(self.cache_salt)
        except KvSwapError as error:
            raise KvSwapError(f"request {self.request_id}: {error}") from None
        if self.max_new_tokens < 1:
            raise KvSwapError(
                f"request {self.request_id}: max_new_tokens = {self.max_new_tokens}; allowed: >= 1"
            )
        if self.follow_up is not None and self.prompt_ids:
            raise KvSwapError(
                f"request {self.request_id}: a follow-up keeps its new tokens in "
                "follow_up.new_user_ids; prompt_ids must be empty"
            )
        if self.follow_up is None and not self.prompt_ids:
            raise KvSwapError(f"request {self.request_id}: prompt_ids is empty")
        if self.follow_up is not None and self.follow_up.previous_request_id >= self.request_id:
            raise KvSwapError(
                f"request {self.request_id}: follows request "
                f"{self.follow_up.previous_request_id}, which is not earlier"
            )

    @property
    def known_prompt_tokens(self) -> int:
        """Prompt tokens known before run time (for a follow-up: its new user tokens)."""
        if self.follow_up is not None:
            return len(self.follow_up.new_user_ids)
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    """An immutable set of requests, `request_id` = 0..n-1 in arrival order."""

    requests: tuple[Request, ...]
    name: str
    vocab_size: int
    # Derived indexes, built once in __post_init__ (the dataclass is frozen).
    _follow_ups: Mapping[int, tuple[Request, ...]] = field(init=False, repr=False, compare=False)
    _resolved_prompt_tokens: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise KvSwapError(
                f"workload {self.name!r}: vocab_size = {self.vocab_size}; allowed >= 1"
            )
        follow_ups: dict[int, list[Request]] = {}
        resolved: list[int] = []
        previous_arrival_s = 0.0
        for index, request in enumerate(self.requests):
            if request.request_id != index:
                raise KvSwapError(
                    f"workload {self.name!r}: request at position {index} has id "
                    f"{request.request_id}; ids must be 0..n-1 in order"
                )
            if request.arrival_s < 0:
                raise KvSwapError(
                    f"workload {self.name!r}: request {index} arrives at {request.arrival_s} s; "
                    "allowed: >= 0"
                )
            if request.arrival_s < previous_arrival_s:
                raise KvSwapError(
                    f"workload {self.name!r}: request {index} arrives at {request.arrival_s} s, "
                    f"before request {index - 1} ({previous_arrival_s} s)"
                )
            previous_arrival_s = request.arrival_s
            if request.follow_up is None:
                resolved.append(len(request.prompt_ids))
                continue
            previous_id = request.follow_up.previous_request_id
            follow_ups.setdefault(previous_id, []).append(request)
            previous = self.requests[previous_id]
            resolved.append(
                resolved[previous_id]
                + previous.max_new_tokens
                + len(request.follow_up.new_user_ids)
            )
        object.__setattr__(
            self, "_follow_ups", {key: tuple(value) for key, value in follow_ups.items()}
        )
        object.__setattr__(self, "_resolved_prompt_tokens", tuple(resolved))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, request_id: int) -> Request:
        return self.requests[request_id]

    def first(self, num_requests: int) -> Workload:
        """The first `num_requests` requests (>= 1) in arrival order; a follow-up
        always comes after the turn it extends, so the result is whole. The same
        workload when it holds no more."""
        if num_requests >= len(self.requests):
            return self
        return Workload(
            requests=self.requests[:num_requests],
            name=f"{self.name}, first {num_requests}",
            vocab_size=self.vocab_size,
        )

    def first_arrivals(self) -> tuple[Request, ...]:
        """Requests that arrive on their own clock (no follow-up), in arrival order."""
        return tuple(request for request in self.requests if request.follow_up is None)

    def follow_ups_of(self, request_id: int) -> tuple[Request, ...]:
        """Requests that extend `request_id` (each turn has at most one in generated sets)."""
        return self._follow_ups.get(request_id, ())

    def total_prompt_tokens(self) -> int:
        """Prompt tokens known up front: whole prompts, plus follow-ups' new user tokens."""
        return sum(request.known_prompt_tokens for request in self.requests)

    def total_output_tokens(self) -> int:
        """Tokens the workload generates (every request runs to max_new_tokens)."""
        return sum(request.max_new_tokens for request in self.requests)

    def resolved_prompt_tokens(self, request_id: int) -> int:
        """Length of the prompt `resolve_prompt` will build for `request_id`.

        Known up front because every request generates exactly max_new_tokens.
        """
        return self._resolved_prompt_tokens[request_id]

    def num_sessions(self) -> int:
        """Distinct conversation ids (requests without a session are not counted)."""
        return len({r.session_id for r in self.requests if r.session_id is not None})


def resolve_prompt(
    request: Request,
    outputs: Mapping[int, Sequence[int]],
    prompts: Mapping[int, Sequence[int]],
) -> tuple[int, ...]:
    """The concrete prompt of `request` at run time.

    `prompts` maps an earlier request id to ITS resolved prompt and `outputs`
    to the tokens it generated; for a follow-up the result is
    prompts[prev] + outputs[prev] + new_user_ids. Other requests return their
    own `prompt_ids` and need neither mapping. Raises LookupError when the
    previous turn has not been resolved or has not finished (a scheduler bug).
    """
    follow_up = request.follow_up
    if follow_up is None:
        return request.prompt_ids
    previous_id = follow_up.previous_request_id
    if previous_id not in prompts or previous_id not in outputs:
        missing = "prompt" if previous_id not in prompts else "output"
        raise LookupError(
            f"request {request.request_id} follows request {previous_id}, whose {missing} "
            "is not known yet"
        )
    return (*prompts[previous_id], *outputs[previous_id], *follow_up.new_user_ids)
