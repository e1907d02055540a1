"""The oracle: Belady's rule with the future read off a run, a reference for host-tier policies.

Belady's rule evicts the block needed furthest in the future; with the true future no
policy hits more. `needs_of_run` reads the future off a replay with an unlimited host tier: for
each offload key, the ticks at which a request whose prompt holds that block arrives.
`OraclePolicy` (a kvswap `EvictionPolicy`, so it ranks the host tier through kvswap's
manager like any other) evicts the copy whose next need after the replay's current tick
(`replay_drive.NOW`) is furthest, never-needed-again first. Turns arrive a think time
after the previous one finishes, so a policy's own hits shift the later ticks a little,
and a need is counted even where the device's prefix cache will serve the block: this
future is not the true one, and the oracle is a reference, not a bound (the reuse
ranking beats it at several sizes).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable
from typing import ClassVar

from vllm.v1.kv_offload.base import make_offload_key

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy
from replay_drive import NOW
from replay_request import chain_hash


def needs_of_run(
    prompts: dict[int, tuple[int, ...]], arrival_ticks: dict[int, int], block_tokens: int
) -> dict[bytes, list[int]]:
    """Offload key -> the sorted arrival ticks of the requests whose prompt holds it."""
    needs: dict[bytes, list[int]] = {}
    for request_id, prompt in prompts.items():
        parent = b""
        for start in range(0, len(prompt) - block_tokens + 1, block_tokens):
            parent = chain_hash(parent, list(prompt[start : start + block_tokens]))
            needs.setdefault(bytes(make_offload_key(parent, 0)), []).append(
                arrival_ticks[request_id]
            )
    for ticks in needs.values():
        ticks.sort()
    return needs


class OraclePolicy(EvictionPolicy):
    """Evicts the copy needed furthest in the future (module docstring)."""

    needs: ClassVar[dict[bytes, list[int]]] = {}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._facts: dict[BlockKey, BlockFacts] = {}

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        self._facts[key] = facts

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        self._facts[key] = facts

    def touch(self, keys: Iterable[BlockKey]) -> None:
        pass

    def remove(self, key: BlockKey) -> None:
        self._facts.pop(key, None)

    def evict(
        self, n: int, protected: Collection[BlockKey] = frozenset(), *, droppable_only: bool = False
    ) -> list[BlockKey] | None:
        now = NOW[0]
        ranked = sorted(
            ((-self._next_need(key, now), key) for key, facts in self._facts.items()
             if facts.may_leave and key not in protected),
        )  # fmt: skip
        if len(ranked) < n:
            return None
        victims = [key for _, key in ranked[:n]]
        for key in victims:
            self.remove(key)
        return victims

    def num_candidates(self) -> int:
        return sum(facts.may_leave for facts in self._facts.values())

    def clear(self) -> None:
        self._facts.clear()

    def _next_need(self, key: BlockKey, now: int) -> float:
        return self._next_need_of(bytes(key), now) if isinstance(key, bytes) else float("inf")

    @classmethod
    def _next_need_of(cls, key: bytes, now: int) -> float:
        ticks = cls.needs.get(key, [])
        at = bisect.bisect_right(ticks, now)
        return float(ticks[at]) if at < len(ticks) else float("inf")


def with_admission(manager: object) -> None:
    """Make `manager` store only the offered keys the future needs again (Belady with
    bypass): the bound for a policy that may also refuse stores (`prepare_store` may
    answer a subset)."""
    prepare_store = manager.prepare_store  # type: ignore[attr-defined]

    def admitted(keys: Iterable[object], req_context: object) -> object:
        now = NOW[0]
        wanted = [k for k in keys if OraclePolicy._next_need_of(bytes(k), now) < float("inf")]  # type: ignore[call-overload]
        return prepare_store(wanted, req_context)

    manager.prepare_store = admitted  # type: ignore[attr-defined]
