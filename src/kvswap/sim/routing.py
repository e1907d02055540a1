"""Split one workload over several simulated engines, a session at a time.

    workload (ids 0..n-1)  --route-->  engine 0: its requests, renumbered 0..m-1
                                       engine 1: ...
                                       (+ each engine's workload-wide ids)

A conversation never changes engine: a later turn goes where the turn it
follows went (its prompt extends that turn's KV). The first turn of each
session (a request without a session id is a session of its own) is routed:

- `round-robin`: the k-th session to arrive goes to engine k mod N. Equal
  prefixes land on every engine, which is what a shared store is for.
- `hash`: sha256 of the first KV block's tokens (the whole prompt if it is
  shorter), mod N. Prompts that share their first block meet on one engine,
  as a prefix-aware router would send them; with ONE system prompt longer than
  a block every session shares that block, so every session lands on one
  engine (the others idle): hash routing spreads load only over distinct
  first blocks.

Deterministic: no Python `hash()`, no randomness; the same workload gives the
same split.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass

from kvswap.config_load import suggest
from kvswap.errors import KvSwapError
from kvswap.workload.request import FollowUp, Request, Workload


class Route(enum.Enum):
    ROUND_ROBIN = "round-robin"
    HASH = "hash"


ROUTE_NAMES: tuple[str, ...] = tuple(route.value for route in Route)


def parse_route(name: str) -> Route:
    for route in Route:
        if route.value == name:
            return route
    raise KvSwapError(
        f"--route {name!r}{suggest(name, ROUTE_NAMES)}; allowed: {', '.join(ROUTE_NAMES)}"
    )


@dataclass(frozen=True)
class EngineShare:
    """One engine's part: its workload (ids 0..m-1 in arrival order) and, for each
    of its requests, the id the request has in the whole workload."""

    workload: Workload
    request_ids: tuple[int, ...]


def first_block_digest(prompt_ids: tuple[int, ...], block_tokens: int) -> int:
    """A stable integer from the first `block_tokens` tokens of a prompt."""
    text = ",".join(map(str, prompt_ids[:block_tokens])).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def route_requests(
    workload: Workload, num_engines: int, route: Route, block_tokens: int
) -> tuple[int, ...]:
    """The engine of every request, by workload-wide id."""
    if num_engines < 1:
        raise KvSwapError(f"num_engines = {num_engines}; allowed: >= 1")
    engines: list[int] = []
    session_engines: dict[int, int] = {}
    num_sessions = 0
    for request in workload:
        if request.follow_up is not None:
            engines.append(engines[request.follow_up.previous_request_id])
            continue
        session = request.session_id
        if session is not None and session in session_engines:
            engines.append(session_engines[session])  # a session's later first arrival
            continue
        if route is Route.ROUND_ROBIN:
            engine = num_sessions % num_engines
        else:
            engine = first_block_digest(request.prompt_ids, block_tokens) % num_engines
        num_sessions += 1
        if session is not None:
            session_engines[session] = engine
        engines.append(engine)
    return tuple(engines)


def split_workload(
    workload: Workload, num_engines: int, route: Route, block_tokens: int
) -> tuple[EngineShare, ...]:
    """Each engine's share of `workload` (an engine may get none)."""
    engines = route_requests(workload, num_engines, route, block_tokens)
    local_ids: dict[int, int] = {}
    parts: list[list[Request]] = [[] for _ in range(num_engines)]
    global_ids: list[list[int]] = [[] for _ in range(num_engines)]
    for request, engine in zip(workload, engines, strict=True):
        local_id = len(parts[engine])
        local_ids[request.request_id] = local_id
        follow_up = request.follow_up
        if follow_up is not None:
            follow_up = FollowUp(
                previous_request_id=local_ids[follow_up.previous_request_id],
                new_user_ids=follow_up.new_user_ids,
                think_time_s=follow_up.think_time_s,
            )
        parts[engine].append(dataclasses.replace(request, request_id=local_id, follow_up=follow_up))
        global_ids[engine].append(request.request_id)
    return tuple(
        EngineShare(
            Workload(
                requests=tuple(requests),
                name=f"{workload.name} [engine {index} of {num_engines}]",
                vocab_size=workload.vocab_size,
            ),
            tuple(global_ids[index]),
        )
        for index, requests in enumerate(parts)
    )
