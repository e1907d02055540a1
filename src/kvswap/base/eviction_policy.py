"""The door to a tier's eviction policy: an ABC keyed by block key, and the facts it ranks by.

In the vocabulary of vLLM's offloading `CachePolicy` (`vllm/v1/kv_offload`):
`insert`, `touch`, `remove`, `evict(n, protected)`, `clear`, plus `update`
(what a copy is ranked by changed) and `advance(step)` (a decode step began).
A policy decides only WHICH copies leave a tier; it never moves or frees
anything (the swapper does) and never reads a `Block`: the store hands it a
`BlockFacts` record with every call, computed at that moment.

Who calls what, in which order. The `BlockStore` is the only caller; it owns
one policy per slot tier (GPU, CPU) and calls a tier's policy only for blocks that
have a copy on that tier:

    advance(step)          once per decode step, first thing in the step
    insert(key, facts)     a copy was placed on this tier (maybe still being
                           written: `facts.busy`); the policy holds `key` from now on
    update(key, facts)     something the copy is ranked by may have changed (its
                           references, a transfer on it started or ended, a copy on
                           another tier appeared or went, the copy arrived from a
                           slower tier: `facts.brought_back`). The store skips it when
                           it knows this tier's facts did not change. A key the policy
                           does not hold (a victim whose copy stayed) is inserted again
    touch(keys)            the blocks were read by a step (most recently used), in
                           a sequence's order, head first; keys the policy does not
                           hold are ignored
    evict(n, protected)    the swapper needs room on this tier: n keys, all or none
                           (None); returned keys are no longer held, and the store
                           calls `update` for one whose copy stays after all
    remove(key)            the copy left the tier, the block was forgotten, or the
                           swapper took the copy as a victim itself (preemption); a
                           later `insert` or `update` brings the key back
    clear()                forget everything

Hard rule: never return a key whose facts are `busy`, `lost` or `running`
(the store checks every victim: a copy under transfer cannot be freed, and a
running sequence's step reads its GPU copies). Everything else is policy.

A policy class is built as `cls(tier, options)` (`PolicyOptions`: the switches,
`capacity_blocks`, the size of the tier it ranks, and `parameters`, those its
name gave), by name through `kvswap.control.policy.build_named`: "kvswap", "lru",
"arc", "reuse", or an import path "package.module:ClassName". A name may carry
parameters the class declares (`PARAMETERS`): "reuse(once=oldest, dead_gaps=1.2)".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from kvswap.base.tier import Tier

#: What a policy calls a block: the store passes its block ids.
BlockKey = Hashable

#: The names `*_eviction_policy` accepts besides an import path "package.module:ClassName".
BUILTIN_POLICY_NAMES = ("kvswap", "lru", "arc", "reuse")


@dataclass(frozen=True)
class PolicyOptions:
    """Which policy evicts from each tier (by name), and the switches of kvswap's:
    sink protection, minimum residency and cost ranks, one at a time."""

    sink_protection: bool = True
    min_residency_steps: int = 64
    cost_aware: bool = True
    gpu_eviction_policy: str = "kvswap"
    cpu_eviction_policy: str = "kvswap"
    nvme_eviction_policy: str = "kvswap"
    # The size of the tier one policy ranks, in its blocks, set by whoever builds it
    # (`kvswap.control.policy.build_named`): ARC's c. None: unknown (ARC learns it).
    capacity_blocks: int | None = None
    # The parameters the policy's name gave ("reuse(once=oldest)": (("once",
    # "oldest"),)), each read by the class's `PARAMETERS`; set by the builder too.
    parameters: tuple[tuple[str, object], ...] = ()

    def policy_name(self, tier: Tier) -> str:
        return str(getattr(self, policy_field(tier)))


def policy_field(tier: Tier) -> str:
    """The configuration field naming `tier`'s policy ("gpu_eviction_policy", ...)."""
    return f"{tier.value}_eviction_policy"


class BlockFacts(NamedTuple):
    """What a policy may rank one tier's copy of a block by, as the store sees it now."""

    referenced: bool  # a sequence's table holds the block (ref_count > 0)
    running: bool  # GPU copies only (else False): a running sequence holds the block
    sink: bool  # GPU copies only (else False): among a holder's first protected blocks
    busy: bool  # this copy is being written, or read by a transfer
    clean: bool  # a ready copy on a slower tier: this one goes without a transfer
    ready_above: bool  # a ready copy on a faster tier (GPU for a CPU copy; CPU or GPU for NVMe)
    lost: bool  # every copy failed: its owners recompute it
    brought_back: bool = False  # this call reports the copy arriving from a slower tier
    # The block's chain key (identity.py), None until it is full: the same for every
    # block that holds the same prefix, so it names the content across a drop and a
    # recompute, which a `BlockKey` (a block id, never reused) does not. ARC's ghost
    # lists remember it.
    content_key: bytes | None = None

    @property
    def may_leave(self) -> bool:
        """The hard rule: a copy under transfer, of a lost block, or that a running step
        reads, is never a victim."""
        return not (self.busy or self.lost or self.running)

    @property
    def droppable(self) -> bool:
        """Goes without a transfer and without a sequence losing its KV: a ready copy
        elsewhere, or nobody references the block (a cache entry is discarded)."""
        return self.clean or self.ready_above or not self.referenced


class EvictionPolicy(ABC):
    """Which copies of one tier leave first. See the module docstring for the call order."""

    #: The parameters a name may give this class ("reuse(once=oldest)"): each with the
    #: function that reads its text, raising ValueError("allowed: ...") on a bad one.
    #: The builder refuses any other name in one line; the class finds the values it
    #: was given in `options.parameters` (`parameter`).
    PARAMETERS: ClassVar[Mapping[str, Callable[[str], object]]] = {}

    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        self.tier = tier
        self.options = options

    def parameter(self, name: str, default: object) -> object:
        """The value the policy's name gave parameter `name`, else `default`."""
        return dict(self.options.parameters).get(name, default)

    @abstractmethod
    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        """A copy of block `key` was placed on this tier."""

    @abstractmethod
    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        """Rank `key` by `facts` again; a key not held is inserted."""

    @abstractmethod
    def touch(self, keys: Iterable[BlockKey]) -> None:
        """These blocks were read by a step; keys not held are ignored."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The copy left the tier (or the block was forgotten); a key not held is ignored."""

    @abstractmethod
    def evict(
        self,
        n: int,
        protected: Collection[BlockKey] = frozenset(),
        *,
        droppable_only: bool = False,
    ) -> list[BlockKey] | None:
        """`n` victims, cheapest first, none of them in `protected` (and, with
        `droppable_only`, all `facts.droppable`), no longer held; None, with nothing
        changed, when fewer than `n` copies qualify."""

    @abstractmethod
    def num_candidates(self) -> int:
        """How many held copies `evict` could return now (admission asks: room on the GPU
        is its free slots plus these)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key."""

    def advance(self, step: int) -> None:  # noqa: B027 - a hook: most policies have no clock
        """A decode step began (`step` counts up). Default: nothing."""

    def admit(self, num_offered: int, num_free: int) -> int:
        """How many of `num_offered` new copies the tier should take, with `num_free`
        slots free: a tier whose writer may store less (vLLM's `prepare_store` may answer
        a subset) asks before it evicts for them. Default: all of them."""
        return num_offered

    def check_integrity(self, keys_with_copy: Collection[BlockKey]) -> None:  # noqa: B027
        """Assert the policy's invariants; `keys_with_copy`: the blocks with a copy on this
        tier (every key held must be one). Default: nothing checked."""
