"""Narrated scenarios of each eviction policy ALONE, on a pool of a few blocks.

The policy sees keys and `BlockFacts` only, as the store would hand them; no
store, no swapper. A few facts records name the states that matter:

    PAUSED_DIRTY  referenced, not running, GPU copy only
    PAUSED_CLEAN  referenced, not running, a ready copy below
    FREE_DIRTY    nobody references it, GPU copy only
    FREE_CLEAN    nobody references it, a ready copy below
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

import pytest

from kvswap.base.eviction_policy import BlockFacts, BlockKey, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.config_load import load_config
from kvswap.control.policy import build_named, build_policy, check_policy_names
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.policy_kvswap import KvSwapGpuPolicy, KvSwapLowerTierPolicy
from kvswap.control.policy_lru import LruPolicy
from kvswap.control.store import BlockStore
from kvswap.control.store_records import StoreLayout
from kvswap.drive.settings import policy_options
from kvswap.errors import ConfigError


def facts(
    *, referenced: bool = True, running: bool = False, sink: bool = False, busy: bool = False,
    clean: bool = False, ready_above: bool = False, brought_back: bool = False,
) -> BlockFacts:  # fmt: skip
    return BlockFacts(referenced, running, sink, busy, clean, ready_above, False, brought_back)


PAUSED_DIRTY = facts()
PAUSED_CLEAN = facts(clean=True)
FREE_DIRTY = facts(referenced=False)
FREE_CLEAN = facts(referenced=False, clean=True)
RUNNING = facts(running=True)


def gpu_policy(**options: object) -> KvSwapGpuPolicy:
    policy = build_policy(Tier.GPU, PolicyOptions(**options))  # type: ignore[arg-type]
    assert isinstance(policy, KvSwapGpuPolicy)
    return policy


def drain(policy: EvictionPolicy) -> list[BlockKey]:
    """Every victim the policy gives, one at a time, in order."""
    victims = []
    while (keys := policy.evict(1)) is not None:
        victims.extend(keys)
    return victims


# ------------------------------------------------------------------ kvswap, GPU


def test_kvswap_keeps_sink_blocks_while_referenced() -> None:
    policy = gpu_policy(min_residency_steps=0)
    policy.insert("sink", facts(sink=True))  # a paused sequence's first block
    policy.insert("body", PAUSED_DIRTY)
    assert policy.num_candidates() == 1
    assert drain(policy) == ["body"]
    # The sequence ends: the sink is an ordinary cache entry now.
    policy.update("sink", FREE_DIRTY)
    assert drain(policy) == ["sink"]


def test_without_sink_protection_a_sink_is_an_ordinary_candidate() -> None:
    policy = gpu_policy(sink_protection=False, min_residency_steps=0)
    policy.insert("sink", facts(sink=True))
    assert drain(policy) == ["sink"]


def test_kvswap_keeps_a_block_brought_back_for_the_minimum_residency() -> None:
    policy = gpu_policy(min_residency_steps=3)
    policy.advance(10)
    # Block "a" arrives from the CPU at step 10 (its window: steps 10-12), and its
    # sequence pauses at once: without the window it would be the next victim.
    policy.insert("a", facts(busy=True))  # placed, being written
    policy.update("a", facts(clean=True, brought_back=True))
    assert policy.evict(1) is None
    for step in (11, 12):
        policy.advance(step)
        assert policy.evict(1) is None, f"step {step}: still inside the window"
    policy.advance(13)
    assert policy.evict(1) == ["a"]


def test_the_window_protects_only_blocks_someone_references() -> None:
    policy = gpu_policy(min_residency_steps=64)
    policy.update("prefix", facts(referenced=False, clean=True, brought_back=True))
    assert policy.evict(1) == ["prefix"]


def test_kvswap_prefers_cheap_victims_clean_before_dirty_unreferenced_before_paused() -> None:
    policy = gpu_policy(min_residency_steps=0)
    # Inserted most expensive first, so that plain recency would pick the wrong one.
    for key, state in (
        ("paused_dirty", PAUSED_DIRTY), ("paused_clean", PAUSED_CLEAN),
        ("free_dirty", FREE_DIRTY), ("free_clean", FREE_CLEAN), ("running", RUNNING),
    ):  # fmt: skip
        policy.insert(key, state)
    # Ranks 0..3: dropped for free, copied out, dropped (swapped in on resume), copied
    # out (swapped in on resume). A running block is never a victim.
    assert drain(policy) == ["free_clean", "free_dirty", "paused_clean", "paused_dirty"]


def test_within_a_rank_the_least_recently_used_goes_first() -> None:
    policy = gpu_policy(min_residency_steps=0)
    for key in ("a", "b", "c"):
        policy.insert(key, FREE_DIRTY)
    policy.touch(["a"])  # read by a step: most recently used
    policy.update("b", FREE_DIRTY)  # nothing changed: keeps its place
    assert drain(policy) == ["b", "c", "a"]


def test_evict_is_atomic_all_n_or_nothing() -> None:
    policy = gpu_policy(min_residency_steps=0)
    policy.insert("a", FREE_CLEAN)
    policy.insert("b", PAUSED_DIRTY)
    policy.insert("c", RUNNING)
    # Three wanted, two candidates: None, and both are still there, in order.
    assert policy.evict(3) is None
    assert policy.num_candidates() == 2
    assert policy.evict(2, protected={"a"}) is None
    assert policy.evict(2) == ["a", "b"]
    assert policy.num_candidates() == 0


def test_droppable_only_skips_the_only_copy_of_a_referenced_block() -> None:
    policy = gpu_policy(min_residency_steps=0)
    policy.insert("paused_dirty", PAUSED_DIRTY)
    assert policy.evict(1, droppable_only=True) is None
    policy.insert("free_dirty", FREE_DIRTY)  # a cache entry: discarding it hurts nobody
    assert policy.evict(1, droppable_only=True) == ["free_dirty"]


# ------------------------------------------------------------------ kvswap, CPU


def test_kvswap_cpu_ranks_drop_before_demote_and_never_discards_a_referenced_only_copy() -> None:
    policy = build_policy(Tier.CPU, PolicyOptions())
    assert isinstance(policy, KvSwapLowerTierPolicy)
    policy.insert("only_copy", PAUSED_DIRTY)  # rank 3: demote only
    policy.insert("on_gpu", facts(ready_above=True))  # rank 2: the GPU copy stays
    policy.insert("cache_entry", FREE_DIRTY)  # rank 1: demote, or discard
    policy.insert("on_nvme", PAUSED_CLEAN)  # rank 0: a ready copy below
    policy.insert("busy", facts(busy=True))  # being read: not a candidate
    # Making room in the pinned pool (droppable only) never takes rank 3 ...
    victims = []
    while (keys := policy.evict(1, droppable_only=True)) is not None:
        victims.extend(keys)
    assert victims == ["on_nvme", "cache_entry", "on_gpu"]
    # ... demotion does.
    assert policy.evict(1) == ["only_copy"]


def test_kvswap_cpu_recency_is_the_last_change_not_a_gpu_read() -> None:
    policy = build_policy(Tier.CPU, PolicyOptions())
    policy.insert("a", FREE_DIRTY)
    policy.insert("b", FREE_DIRTY)
    policy.touch(["a"])  # a read on the GPU: CPU copies keep their order
    assert policy.evict(1) == ["a"]
    policy.insert("a", FREE_DIRTY)
    policy.update("b", FREE_DIRTY)  # any change counts as a use
    assert drain(policy) == ["a", "b"]


# ------------------------------------------------------------------ plain LRU


def test_lru_evicts_in_recency_order_ignoring_sinks_windows_and_cost() -> None:
    policy = build_policy(Tier.GPU, PolicyOptions(gpu_eviction_policy="lru"))
    assert isinstance(policy, LruPolicy)
    policy.insert("sink", facts(sink=True))
    policy.insert("young", facts(brought_back=True))
    policy.insert("free_clean", FREE_CLEAN)
    policy.insert("paused_dirty", PAUSED_DIRTY)
    policy.touch(["sink"])  # now the most recently used
    assert drain(policy) == ["young", "free_clean", "paused_dirty", "sink"]


def test_lru_touch_leaves_a_chain_s_head_most_recent_so_the_chain_leaves_from_its_end() -> None:
    policy = build_policy(Tier.CPU, PolicyOptions(cpu_eviction_policy="lru"))
    for key in ("tail", "middle", "head", "other"):  # offloaded tail first, as the swapper does
        policy.insert(key, FREE_DIRTY)
    # A sequence takes the chain again: the store touches its blocks head first.
    policy.touch(["head", "middle", "tail"])
    # Were the head the oldest of the three, evicting it would strand the rest: a prefix
    # is found only from its head. As vLLM's LRU does, the tail goes first.
    assert drain(policy) == ["other", "tail", "middle", "head"]


def test_lru_skips_what_may_not_leave_and_keeps_its_place() -> None:
    policy = build_policy(Tier.GPU, PolicyOptions(gpu_eviction_policy="lru"))
    policy.insert("a", RUNNING)
    policy.insert("b", FREE_DIRTY)
    policy.insert("c", facts(busy=True))
    assert policy.num_candidates() == 1
    assert policy.evict(2) is None  # atomic: "b" is still there
    # "a" pauses and "c"'s transfer ends: both rejoin at their old places.
    policy.update("a", PAUSED_DIRTY)
    policy.update("c", FREE_CLEAN)
    assert policy.evict(2, protected={"b"}) == ["a", "c"]
    assert drain(policy) == ["b"]
    policy.check_integrity(set())


# ------------------------------------------------------------------ by name


class FifoPolicy(EvictionPolicy):
    """A user's policy: first in, first out, among copies that may leave."""

    def __init__(self, tier: Tier, options: PolicyOptions) -> None:
        super().__init__(tier, options)
        self.facts: OrderedDict[BlockKey, BlockFacts] = OrderedDict()

    def insert(self, key: BlockKey, facts: BlockFacts) -> None:
        self.facts[key] = facts

    def update(self, key: BlockKey, facts: BlockFacts) -> None:
        self.facts[key] = facts

    def touch(self, keys: Iterable[BlockKey]) -> None:
        pass

    def remove(self, key: BlockKey) -> None:
        self.facts.pop(key, None)

    def evict(
        self, n: int, protected: Collection[BlockKey] = frozenset(), *, droppable_only: bool = False
    ) -> list[BlockKey] | None:
        keys = [k for k, f in self.facts.items() if f.may_leave and k not in protected]
        if droppable_only:
            keys = [k for k in keys if self.facts[k].droppable]
        if len(keys) < n:
            return None
        for key in keys[:n]:
            del self.facts[key]
        return keys[:n]

    def num_candidates(self) -> int:
        return sum(f.may_leave for f in self.facts.values())

    def clear(self) -> None:
        self.facts.clear()


def test_a_user_policy_named_by_import_path_is_used_by_the_store() -> None:
    options = PolicyOptions(gpu_eviction_policy=f"{__name__}:FifoPolicy")
    store = BlockStore(StoreLayout(4, 4, 4, 0), options)
    assert isinstance(store.policies[Tier.GPU], FifoPolicy)
    assert isinstance(store.policies[Tier.CPU], KvSwapLowerTierPolicy)
    # Two paused sequences of one block each; the first one placed leaves first.
    for seq_id, first_token in ((1, 0), (2, 100)):
        store.open_sequence(seq_id, list(range(first_token, first_token + 4)))
        block = store.append_tokens(seq_id, list(range(first_token, first_token + 4)))[0]
        store.place(block, Tier.GPU, ready=True)
    store.touch(store.sequence_blocks(1))  # FIFO ignores it
    assert store.num_eviction_candidates(Tier.GPU) == 2
    with store.victims(Tier.GPU) as victims:
        victim = victims.next()
        assert victim is not None and victim.block_id == store.sequences[1].block_ids[0]
    store.check_integrity()  # the victim stayed: ranked again when the round closed
    assert store.num_eviction_candidates(Tier.GPU) == 2


def test_a_victim_round_ranks_again_only_what_stayed_and_no_change_reached() -> None:
    """Four paused one-block sequences on the GPU, ranked by LRU. A round hands out
    a, b, c: a stays, b is moved (its source reserved: ranked busy at once), c's
    GPU copy is dropped (a CPU copy holds it). A nested round takes d, chosen by
    the caller, and leaves it. Closed, every copy left is ranked exactly once."""
    store = BlockStore(StoreLayout(4, 4, 4, 0), PolicyOptions(gpu_eviction_policy="lru"))
    blocks = []
    for seq_id in range(4):
        tokens = list(range(10 * seq_id, 10 * seq_id + 4))
        store.open_sequence(seq_id, tokens)
        block = store.append_tokens(seq_id, tokens)[0]
        store.place(block, Tier.GPU, ready=True)
        blocks.append(block)
    a, b, c, d = blocks
    store.place(c, Tier.CPU, ready=True)
    with store.victims(Tier.GPU) as victims:
        assert [victims.next(), victims.next(), victims.next()] == [a, b, c]
        assert store.num_eviction_candidates(Tier.GPU) == 1  # only d is ranked now
        store.reserve_source(b, Tier.GPU)  # a move: ranked again, busy
        store.drop_copy(c, Tier.GPU)  # gone from the tier
        with store.victims(Tier.GPU) as chosen:
            chosen.take(d)
            assert store.num_eviction_candidates(Tier.GPU) == 0
        assert store.num_eviction_candidates(Tier.GPU) == 1  # d, ranked again
    store.check_integrity()
    assert store.num_eviction_candidates(Tier.GPU) == 2  # a and d; b is busy, c gone
    store.release_source(b, Tier.GPU)
    assert store.num_eviction_candidates(Tier.GPU) == 3
    store.check_integrity()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("fifo", "unknown policy"),
        ("no_such_module_kvswap:Policy", "cannot import 'no_such_module_kvswap'"),
        (f"{__name__}:Nothing", "is nothing, not an EvictionPolicy subclass"),
        (f"{__name__}:facts", "is a function, not an EvictionPolicy subclass"),
    ],
)
def test_a_bad_policy_name_is_one_config_error_naming_field_value_and_allowed(
    value: str, says: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_policy_names(PolicyOptions(cpu_eviction_policy=value))
    message = str(caught.value)
    assert message.startswith(f"cpu_eviction_policy = {value!r}: ")
    allowed = "allowed: 'kvswap', 'lru', 'arc' or 'reuse', or an import path"
    assert says in message and allowed in message
    assert "\n" not in message


def test_the_config_names_each_tier_s_policy_and_a_bad_name_stops_at_the_edge() -> None:
    config = load_config(None, overrides={"gpu_eviction_policy": "lru"})
    options = policy_options(config)
    assert (options.gpu_eviction_policy, options.cpu_eviction_policy) == ("lru", "kvswap")
    assert isinstance(BlockStore(StoreLayout(4, 4, 4, 0), options).policies[Tier.GPU], LruPolicy)
    bad = load_config(None, overrides={"nvme_eviction_policy": "mru"})
    with pytest.raises(ConfigError, match=r"^nvme_eviction_policy = 'mru': unknown policy; "):
        policy_options(bad)


def test_a_caller_may_name_the_setting_its_users_know_the_policy_by() -> None:
    with pytest.raises(ConfigError, match=r"^eviction_policy = 'mru': unknown policy; "):
        build_named("mru", Tier.CPU, PolicyOptions(), field="eviction_policy", top=True)


def test_kvswap_names_the_top_tier_s_table_wherever_the_builder_says_the_tier_is_top() -> None:
    # vLLM's host tier is the CPU, and the top tier kvswap ranks there (vLLM ranks its
    # device pool itself): it gets the table with sinks and residency, not the GPU's name.
    top = build_named("kvswap", Tier.CPU, PolicyOptions(), field="eviction_policy", top=True)
    below = build_named("kvswap", Tier.CPU, PolicyOptions(), field="eviction_policy", top=False)
    assert (type(top), type(below)) == (KvSwapGpuPolicy, KvSwapLowerTierPolicy)
    assert top.tier is Tier.CPU
    # The engine's tiers: the GPU is the top one.
    assert isinstance(build_policy(Tier.GPU, PolicyOptions()), KvSwapGpuPolicy)
    assert isinstance(build_policy(Tier.CPU, PolicyOptions()), KvSwapLowerTierPolicy)


def test_the_store_builds_each_tier_s_policy_with_that_tier_s_size() -> None:
    options = PolicyOptions(gpu_eviction_policy="arc", cpu_eviction_policy="arc")
    store = BlockStore(StoreLayout(4, 6, 3, 0), options)
    sizes = {tier: policy.options.capacity_blocks for tier, policy in store.policies.items()}
    assert sizes == {Tier.GPU: 6, Tier.CPU: 3}  # a keyed tier ranks by its own
    arc = store.policies[Tier.GPU]
    assert isinstance(arc, ArcPolicy) and arc.state().capacity_blocks == 6  # c before any use


def _window(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise ValueError("allowed: a whole number of blocks > 0")
    return int(text)


class WindowedFifo(FifoPolicy):
    """A user's policy with a parameter of its own."""

    PARAMETERS = {"window": _window}  # noqa: RUF012 - a test's class, never mutated


def test_a_user_s_policy_declares_its_parameters_and_reads_them_by_name() -> None:
    name = f"{__name__}:WindowedFifo(window=3)"
    policy = build_named(name, Tier.CPU, PolicyOptions(), field="cpu_eviction_policy", top=False)
    assert isinstance(policy, WindowedFifo)
    assert policy.parameter("window", 1) == 3 and policy.parameter("other", "x") == "x"
    assert build_named(f"{__name__}:WindowedFifo", Tier.CPU, PolicyOptions(),
                       field="f", top=False).parameter("window", 1) == 1  # fmt: skip
    bad = f"{__name__}:WindowedFifo(window=0)"
    with pytest.raises(ConfigError) as caught:
        check_policy_names(PolicyOptions(cpu_eviction_policy=bad))
    assert str(caught.value) == (
        f"cpu_eviction_policy = {bad!r}: window = '0': allowed: a whole number of blocks > 0"
    )
    missing = "no_such_module_kvswap:Policy(window=3)"
    with pytest.raises(ConfigError) as caught:
        check_policy_names(PolicyOptions(cpu_eviction_policy=missing))
    assert str(caught.value).startswith(f"cpu_eviction_policy = {missing!r}: cannot import")
