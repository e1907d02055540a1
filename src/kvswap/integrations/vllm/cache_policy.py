"""vLLM's `CachePolicy` in kvswap's words: kvswap's `EvictionPolicy` ranks the host tier.

vLLM's device pool and its prefix-cache eviction are not pluggable; its host
tier is, so the host tier is the top tier kvswap ranks here (`build_named(...,
top=True)`: "kvswap" is the table with sinks, minimum residency and cost), sized
by vLLM's `cache_capacity`. Every vLLM call becomes the kvswap call with the
`BlockFacts` of the chunk at that moment; kvswap's policy decides, this class
only keeps what vLLM's calls say about each chunk:

    vLLM (CPUOffloadingManager)          kvswap (EvictionPolicy)     facts
    insert(key, chunk[, req_context])    insert                      busy (being written)
    mark_evictable / mark_non_evictable  update                      busy: a transfer reads
                                                                     or writes it (ref_cnt)
    on_store_miss, on_request_access,    update                      referenced: a live request
      insert with a req_context                                      holds it; sink: and it is
                                                                     among the request's first
                                                                     protected_sink_blocks
    on_request_finished(key_groups)      update, tail first; touch   referenced dropped
    touch                                touch
    evict(n, protected)                  evict(n, protected)         all n or None
    remove / clear                       remove / clear
    (the manager) brought_back(keys)     update                      brought_back, clean
    (the manager) copied_below(keys)     update                      clean: a ready copy in a
                                                                     secondary tier
    (the manager) advance(step)          advance                     the residency clock

A request's references drop tail first, as kvswap's `BlockStore.close_sequence`
drops them: the head of a chain ends most recently used, so eviction shortens a
cached prefix from its end and what stays is still a usable prefix.

Built by vLLM's factory alone (`eviction_policy: "KvswapCachePolicy"` with vLLM's
own CPU spec), it gets only `cache_capacity`: no block size, so no sinks, and no
step clock, so no residency windows. `KvswapOffloadingSpec` builds it with both.

A policy that raises (a user's `module:Class`, say) never reaches vLLM: the call's
store is refused (`evict` answers None), the failure is counted (`num_failures`)
and logged once, and the tier goes on ranked by kvswap's LRU, rebuilt from what
this class knows of every chunk. The same for an `evict` that names a chunk it
may not (not held, or busy: the hard rule).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from kvswap.base.eviction_policy import BlockFacts, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.control.policy import build_named
from kvswap.control.request_fault import failure_reason
from kvswap.units import ceil_div

LOGGER = logging.getLogger("vllm.kvswap")  # under vLLM's logger (host_report.py)
_T = TypeVar("_T")


@dataclass(frozen=True)
class HostRanking:
    """How the host tier is ranked: kvswap's policy `policy_name` with the switches of
    `options` and, for sinks, the tokens of one host-tier block (an offloaded chunk).
    `tokens_per_chunk` None: no sinks (the block size is unknown)."""

    policy_name: str = "kvswap"
    options: PolicyOptions = field(default_factory=lambda: PolicyOptions(min_residency_steps=0))
    protected_sink_blocks: int = 8
    tokens_per_chunk: int | None = None
    field_name: str = "eviction_policy"


@dataclass
class _Chunk:
    """What vLLM said about one held chunk."""

    status: Any  # vLLM's ChunkStatus, handed back by get() and evict()
    evictable: bool = False
    clean: bool = False
    arriving: bool = False  # a promotion from a secondary tier: brought back when ready


class KvswapCachePolicy(CachePolicy):
    """The host tier's chunks, ranked by kvswap's `EvictionPolicy` (module docstring)."""

    def __init__(self, cache_capacity: int, ranking: HostRanking | None = None) -> None:
        super().__init__(cache_capacity)
        self.ranking = ranking if ranking is not None else HostRanking()
        self.policy = self._build(self.ranking.policy_name)
        self.num_failures = 0  # calls the policy raised in (it is then replaced by LRU)
        self._chunks: dict[bytes, _Chunk] = {}
        self._refs: dict[bytes, int] = {}  # key -> live requests holding it
        self._held: dict[str, set[bytes]] = {}  # request id -> keys it holds
        self._sinks: set[bytes] = set()  # keys among the first protected blocks

    # --- vLLM's CachePolicy ---------------------------------------------------------

    def get(self, key: bytes) -> Any:
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.status

    def insert(self, key: bytes, chunk: Any, req_context: Any = None) -> None:
        """A chunk allocated for `key`, not yet written (vLLM 0.33 passes the storing
        request's context; 0.32 announced it in `on_store_miss`)."""
        if req_context is not None:
            self._hold([key], req_context)
        self._chunks[key] = _Chunk(chunk)
        facts = self._facts(key)
        self._rank(lambda policy: policy.insert(key, facts), None)

    def remove(self, key: bytes) -> None:
        if self._chunks.pop(key, None) is not None:
            self._rank(lambda policy: policy.remove(key), None)

    def touch(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        held = [key for key in keys if key in self._chunks]
        self._rank(lambda policy: policy.touch(held), None)

    def on_store_miss(self, keys: Iterable[bytes], req_context: Any) -> None:
        """The request will store these keys: it holds them from now on."""
        self._hold(keys, req_context)

    def on_request_access(self, keys: Iterable[bytes], req_context: Any) -> None:
        """vLLM 0.33: the request's first access to these keys: it holds them."""
        self._hold(keys, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: set[bytes],
        reused_keys: set[bytes],
        req_context: Any,
    ) -> None:
        """The request's references drop, tail first (module docstring); what it read or
        stored was used."""
        # vLLM 0.32 tells a policy of a request's loads only now (`reused_keys`; 0.33
        # also in on_request_access): a reuse is a reference taken, held until the end.
        self._hold(reused_keys, req_context)
        held = self._held.pop(req_context.req_id, set())
        ordered = [key for group in key_groups for key in group]
        tail_first = [key for key in reversed(ordered) if key in held]
        seen = set(tail_first)
        for key in tail_first + [key for key in held if key not in seen]:
            self._release(key)
        self.touch(reversed(ordered))

    def admit(self, num_offered: int, num_free: int) -> int:
        """How many of `num_offered` new chunks to store, `num_free` chunks being free (the
        ranking's `EvictionPolicy.admit`; a failure there admits what is free)."""
        return self._rank(lambda policy: policy.admit(num_offered, num_free), num_free)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Any]] | None:
        keys = self._rank(lambda policy: policy.evict(n, protected), None)
        if keys is None:
            return None
        for key in keys:  # all checked before any leaves: a refusal changes nothing
            chunk = self._chunks.get(key) if isinstance(key, bytes) else None
            if chunk is None or not chunk.evictable or chunk.status.ref_cnt != 0:
                self._replace(RuntimeError(
                    f"{type(self.policy).__name__}.evict returned {key!r}: not a chunk "
                    "held, or one a transfer uses (the hard rule: never a busy copy)"
                ))  # fmt: skip
                return None
        return [(key, self._chunks.pop(key).status) for key in keys if isinstance(key, bytes)]

    def clear(self) -> None:
        self._chunks.clear()
        self._refs.clear()
        self._held.clear()
        self._sinks.clear()
        self._rank(lambda policy: policy.clear(), None)

    def mark_evictable(self, key: bytes) -> None:
        chunk = self._chunks[key]
        chunk.evictable = True
        brought_back, chunk.arriving = chunk.arriving, False
        self._update(key, brought_back=brought_back)

    def mark_non_evictable(self, key: bytes) -> None:
        self._chunks[key].evictable = False
        self._update(key)

    # --- what the manager tells it --------------------------------------------------

    def advance(self, step: int) -> None:
        """A scheduler step ended (the manager's clock): residency windows move on."""
        self._rank(lambda policy: policy.advance(step), None)

    def arriving(self, keys: Iterable[bytes]) -> None:
        """These chunks are promotions: once written they were brought back from a
        secondary tier (which therefore holds a copy)."""
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None:
                chunk.arriving = True
                chunk.clean = True

    def copied_below(self, keys: Iterable[bytes]) -> None:
        """A secondary tier now holds these chunks: dropping them costs no transfer."""
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None and not chunk.clean:
                chunk.clean = True
                self._update(key)

    # --- internal -------------------------------------------------------------------

    def _update(self, key: bytes, *, brought_back: bool = False) -> None:
        facts = self._facts(key, brought_back=brought_back)
        self._rank(lambda policy: policy.update(key, facts), None)

    def _rank(self, call: Callable[[EvictionPolicy], _T], failed: _T) -> _T:
        """`call(self.policy)`; if the policy raises, it is replaced (`_replace`) and the
        call answers `failed` (the replacement already ranks by the state it changed)."""
        try:
            return call(self.policy)
        except Exception as error:
            self._replace(error)
            return failed

    def _replace(self, error: Exception) -> None:
        """The policy failed: count it, say so once, and rank every chunk held with
        kvswap's LRU from now on (the chunks and their facts are this class's own)."""
        self.num_failures += 1
        if self.num_failures == 1:
            LOGGER.warning(
                "kvswap: the host tier's policy %s failed (%s); the store that asked is "
                "refused and the tier is ranked by kvswap's LRU from now on",
                type(self.policy).__name__, failure_reason(error),
            )  # fmt: skip
        self.policy = self._build("lru")
        for key in self._chunks:
            self.policy.insert(key, self._facts(key))

    def _build(self, name: str) -> EvictionPolicy:
        """The host tier's policy `name`: the top tier kvswap ranks, of vLLM's size."""
        ranking = self.ranking
        return build_named(
            name, Tier.CPU, ranking.options, field=ranking.field_name, top=True,
            capacity_blocks=self.cache_capacity,
        )  # fmt: skip

    def _facts(self, key: bytes, *, brought_back: bool = False) -> BlockFacts:
        chunk = self._chunks[key]
        referenced = self._refs.get(key, 0) > 0
        return BlockFacts(
            referenced=referenced,
            running=False,  # vLLM's running requests read the device pool, never this tier
            sink=referenced and key in self._sinks,
            busy=not chunk.evictable,
            clean=chunk.clean,
            ready_above=False,  # vLLM's device pool is its own: not known here
            lost=False,
            brought_back=brought_back,
            # vLLM's key is its block hash: it names the content across an eviction
            # and a store again, which ARC's ghost lists remember.
            content_key=key,
        )

    def _hold(self, keys: Iterable[bytes], req_context: Any) -> None:
        held = self._held.setdefault(req_context.req_id, set())
        for key in keys:
            if key in held:
                continue
            held.add(key)
            self._refs[key] = self._refs.get(key, 0) + 1
            if self._is_sink(key, req_context):
                self._sinks.add(key)
            if self._refs[key] == 1 and key in self._chunks:
                self._update(key)

    def _release(self, key: bytes) -> None:
        count = self._refs.get(key, 0) - 1
        if count > 0:
            self._refs[key] = count
            return
        self._refs.pop(key, None)
        self._sinks.discard(key)  # a sink only while a request holds it
        if key in self._chunks:
            self._update(key)

    def _is_sink(self, key: bytes, req_context: Any) -> bool:
        """Among the first `protected_sink_blocks` host blocks of the request, by the end
        position vLLM records for each key (`ReqContext.get_offload_key_position`)."""
        tokens = self.ranking.tokens_per_chunk
        if tokens is None or not self.ranking.options.sink_protection:
            return False
        end_position = req_context.get_offload_key_position(key)
        if end_position is None:
            return False
        return ceil_div(end_position, tokens) <= self.ranking.protected_sink_blocks
