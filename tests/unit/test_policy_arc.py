"""Narrated scenarios of ARC (policy_arc.py) alone, on a pool of a few blocks, then
through the store, then random calls against its invariants.

The policy sees keys and `BlockFacts` only, as the store would hand them. A key
here is a block id ("a", "b", ...); its content key (the chain key that names
the prefix it holds, what the ghost lists remember) is `content("a")`. A new
block holding the same prefix gets a new id but the same content key.

    cached(x)   a cache entry: nobody references it, the only copy (may leave)
    held(x)     a sequence's table holds it (a paused one: may leave)
    writing(x)  a copy being written: busy, not a candidate
"""

from __future__ import annotations

import random

import pytest

from kvswap.base.eviction_policy import BlockFacts, BlockKey, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.config_load import load_config
from kvswap.control.policy import build_policy
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.store import BlockStore
from kvswap.control.store_records import StoreLayout
from kvswap.drive.settings import policy_options


def content(name: str) -> bytes:
    return f"chain-key:{name}".encode()


def facts(
    name: str, *, referenced: bool = False, running: bool = False, busy: bool = False,
    clean: bool = False, ready_above: bool = False, lost: bool = False,
) -> BlockFacts:  # fmt: skip
    return BlockFacts(
        referenced, running, False, busy, clean, ready_above, lost, False, content(name)
    )


def cached(name: str) -> BlockFacts:
    return facts(name)


def held(name: str) -> BlockFacts:
    return facts(name, referenced=True)


def writing(name: str) -> BlockFacts:
    return facts(name, busy=True)


def arc(tier: Tier = Tier.CPU) -> ArcPolicy:
    policy = build_policy(tier, load_policy_options(**{f"{tier.value}_eviction_policy": "arc"}))
    assert isinstance(policy, ArcPolicy)
    return policy


def load_policy_options(**overrides: object) -> PolicyOptions:
    return policy_options(load_config(None, overrides=overrides))


def fill(policy: ArcPolicy, *names: str) -> None:
    for name in names:
        policy.insert(name, cached(name))


def reuse(policy: ArcPolicy, name: str) -> None:
    """A request takes the block (its first reference) and lets it go again."""
    policy.update(name, held(name))
    policy.update(name, cached(name))


# ------------------------------------------------------------------ T1 and T2


def test_new_copies_enter_t1_and_a_request_reusing_one_moves_it_to_t2() -> None:
    policy = arc()
    fill(policy, "a", "b", "c")
    assert policy.state().t1 == ("a", "b", "c") and policy.state().t2 == ()
    # A new request finds "b" in the tier and takes it: reused, so frequent.
    policy.update("b", held("b"))
    assert policy.state().t1 == ("a", "c") and policy.state().t2 == ("b",)
    # It lets go: no further move. p is 0, so T1 (|T1| = 2 >= 0) gives the victims,
    # oldest first, and their content becomes B1's ghosts.
    policy.update("b", cached("b"))
    assert policy.evict(2) == ["a", "c"]
    assert policy.state().b1 == (content("a"), content("c"))
    # T1 is empty: T2 gives the next one, and its ghost goes to B2.
    assert policy.evict(1) == ["b"]
    assert policy.state().b2 == (content("b"),)
    policy.check_integrity(set())


def test_a_second_reuse_makes_the_copy_t2_s_most_recent() -> None:
    policy = arc()
    fill(policy, "a", "b")
    reuse(policy, "a")
    reuse(policy, "b")
    reuse(policy, "a")
    assert policy.state().t2 == ("b", "a")


def test_a_paused_sequence_keeping_its_reference_is_no_reuse() -> None:
    policy = arc()
    # Swapped out while its (paused) sequence holds it: inserted referenced.
    policy.insert("a", held("a"))
    # Other facts change (a transfer starts and ends) while the reference stays.
    policy.update("a", facts("a", referenced=True, busy=True))
    policy.update("a", held("a"))
    policy.touch(["a"])  # the sequence resumes: resident again, still no reuse
    assert policy.state().t1 == ("a",)


def test_a_copy_still_being_written_is_not_reused_as_vllm_keeps_unready_chunks_in_t1() -> None:
    policy = arc()
    policy.insert("a", writing("a"))
    policy.update("a", facts("a", referenced=True, busy=True))  # taken before it landed
    policy.update("a", held("a"))  # landed: the reference did not change, no reuse
    assert policy.state().t1 == ("a",)


def test_touch_refreshes_within_a_list_tail_first_so_a_chain_s_head_is_most_recent() -> None:
    policy = arc()
    fill(policy, "head", "middle", "tail", "other")
    reuse(policy, "other")
    policy.touch(["head", "middle", "tail", "other"])  # a sequence's order: head first
    assert policy.state().t1 == ("tail", "middle", "head")  # no promotion by a touch
    assert policy.state().t2 == ("other",)
    # The chain leaves from its end: what stays is still a usable prefix.
    assert policy.evict(2) == ["tail", "middle"]


# ------------------------------------------------------------------ ghosts and p


def test_a_b1_ghost_hit_grows_p_and_then_t2_gives_the_victims() -> None:
    policy = arc()
    fill(policy, "a", "b", "c", "d")  # the tier holds 4: c = 4
    reuse(policy, "c")
    reuse(policy, "d")  # T1 = a b, T2 = c d
    assert policy.evict(2) == ["a", "b"]  # p = 0: T1 first; B1 = a b
    # "a" was dropped and recomputed: a new block, same prefix, stored again. Its
    # content is in B1: recency would have paid, so p grows by max(1, |B2|/|B1|) = 1.
    policy.insert("a2", cached("a"))
    state = policy.state()
    assert state.target_t1_blocks == 1.0 and state.b1 == (content("b"),)
    assert state.t1 == ("a2",)  # a store is no frequency hit: T1, as vLLM does
    # |T1| = 1 >= int(p) = 1 still: T1 gives the next victim ...
    assert policy.evict(1) == ["a2"]
    # ... then a second B1 hit makes p = 2 > |T1| = 1: T2's oldest leaves instead.
    policy.insert("b2", cached("b"))
    assert policy.state().target_t1_blocks == 2.0
    assert policy.evict(1) == ["c"]
    assert policy.state().b2 == (content("c"),)
    policy.check_integrity({"b2", "d"})


def test_a_b2_ghost_hit_shrinks_p_by_the_ratio_of_the_ghost_lists() -> None:
    policy = arc()
    fill(policy, "a", "b", "c", "d")
    for name in ("a", "b", "c"):
        reuse(policy, name)  # T1 = d, T2 = a b c
    policy.insert("x", cached("x"))  # a 5th copy: c = 5
    # Grow p first: d and x leave T1 (B1 = d x), d comes back (p = 1).
    assert policy.evict(2) == ["d", "x"]
    policy.insert("d2", cached("d"))
    assert policy.state().target_t1_blocks == 1.0
    # |T1| = 1 >= 1: T1's d2 leaves; then |T1| = 0 < 1: T2's oldest, a.
    assert policy.evict(2) == ["d2", "a"]
    assert policy.state().b1 == (content("x"), content("d"))
    assert policy.state().b2 == (content("a"),)
    # "a" comes back: it had been frequent, so p shrinks by max(1, |B1|/|B2|) = 2.
    policy.insert("a2", cached("a"))
    assert policy.state().target_t1_blocks == 0.0  # 1 - 2, floored at 0
    assert policy.state().b2 == ()


def test_p_is_capped_at_the_most_copies_held_and_ghost_lists_at_that_many() -> None:
    policy = arc()
    fill(policy, "a", "b")  # c = 2
    assert policy.evict(2) == ["a", "b"]
    policy.insert("a2", cached("a"))
    policy.insert("b2", cached("b"))
    assert policy.state().target_t1_blocks == 2.0  # 1 + max(1, 0/1) -> capped at c = 2
    # Ghosts beyond c are forgotten oldest first.
    assert policy.evict(2) == ["a2", "b2"]
    fill(policy, "e", "f")
    assert policy.evict(2) == ["e", "f"]
    assert policy.state().b1 == (content("e"), content("f"))
    assert policy.state().capacity_blocks == 2
    policy.check_integrity(set())


def test_a_victim_that_stays_goes_back_to_its_list_without_adapting_p() -> None:
    policy = arc()
    fill(policy, "a", "b")
    reuse(policy, "b")
    assert policy.evict(2) == ["a", "b"]
    # Neither could leave after all (no room below): the store ranks them again.
    policy.update("a", cached("a"))
    policy.update("b", cached("b"))
    state = policy.state()
    assert (state.t1, state.t2, state.b1, state.b2) == (("a",), ("b",), (), ())
    assert state.target_t1_blocks == 0.0


def test_a_copy_that_leaves_by_another_way_leaves_a_ghost_too() -> None:
    policy = arc()
    fill(policy, "a", "b")
    reuse(policy, "b")
    policy.remove("a")  # moved down, or forgotten
    policy.remove("b")
    assert policy.state().b1 == (content("a"),) and policy.state().b2 == (content("b"),)
    policy.remove("a")  # not held: ignored
    policy.check_integrity(set())


def test_a_block_not_yet_full_has_no_content_and_leaves_no_ghost() -> None:
    policy = arc()
    partial = BlockFacts(False, False, False, False, False, False, False)
    policy.insert("partial", partial)
    assert policy.evict(1) == ["partial"]
    assert policy.state().b1 == ()


# ------------------------------------------------------------------ the interface's rules


def test_the_hard_rule_busy_lost_and_running_copies_never_leave_and_keep_their_place() -> None:
    policy = arc(Tier.GPU)
    policy.insert("writing", writing("writing"))
    policy.insert("lost", facts("lost", lost=True))
    policy.insert("running", facts("running", referenced=True, running=True))
    policy.insert("free", cached("free"))
    assert policy.num_candidates() == 1
    assert policy.evict(2) is None
    assert policy.evict(1) == ["free"]
    assert policy.evict(1) is None
    # The write ends and the sequence pauses: both rejoin at their old places.
    policy.update("running", held("running"))
    policy.update("writing", cached("writing"))
    assert policy.evict(2) == ["writing", "running"]
    policy.check_integrity({"lost"})


def test_evict_is_atomic_all_n_or_nothing_changed() -> None:
    policy = arc()
    fill(policy, "a", "b", "c")
    reuse(policy, "c")
    policy.insert("busy", writing("busy"))
    before = policy.state()
    assert policy.evict(4) is None  # three candidates
    assert policy.evict(3, protected={"b"}) is None
    assert policy.evict(2, droppable_only=True, protected={"a", "b"}) is None
    assert policy.state() == before and policy.num_candidates() == 3
    assert policy.evict(3) == ["a", "b", "c"]


def test_protected_and_droppable_only_skip_copies_that_stay_candidates() -> None:
    policy = arc()
    policy.insert("only_copy", held("only_copy"))  # a paused sequence's only copy
    policy.insert("on_gpu", facts("on_gpu", referenced=True, ready_above=True))
    fill(policy, "cached")
    # Making room without a transfer never takes the only copy of a referenced block.
    assert policy.evict(1, droppable_only=True, protected={"on_gpu"}) == ["cached"]
    assert policy.evict(1, droppable_only=True) == ["on_gpu"]
    assert policy.evict(1, droppable_only=True) is None
    assert policy.evict(1) == ["only_copy"]
    policy.check_integrity(set())


def test_clear_forgets_keys_ghosts_and_p() -> None:
    policy = arc()
    fill(policy, "a", "b")
    assert policy.evict(1) == ["a"]
    policy.insert("a2", cached("a"))
    policy.clear()
    state = policy.state()
    assert (state.t1, state.t2, state.b1, state.b2, state.target_t1_blocks) == ((), (), (), (), 0)
    assert policy.num_candidates() == 0


# ------------------------------------------------------------------ by name, through the store


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.CPU, Tier.NVME])
def test_arc_is_chosen_by_name_on_every_tier(tier: Tier) -> None:
    assert isinstance(arc(tier), ArcPolicy)


def test_through_the_store_a_recomputed_prefix_is_recognised_by_its_content() -> None:
    options = load_policy_options(cpu_eviction_policy="arc")
    store = BlockStore(StoreLayout(4, 8, 2, 0), options)
    policy = store.policies[Tier.CPU]
    assert isinstance(policy, ArcPolicy)
    prompt = list(range(9))  # two full blocks and one token to compute

    def finish_turn(seq_id: int) -> list[int]:
        """Open, compute and close a sequence whose blocks land on the CPU."""
        hits = store.open_sequence(seq_id, prompt)
        blocks = [*hits, *store.append_tokens(seq_id, prompt[len(hits) * 4 :])]
        for block in blocks[len(hits) :]:
            store.place(block, Tier.GPU, ready=True)
        store.publish_computed()
        for block in store.close_sequence(seq_id):
            if Tier.CPU not in block.copies:
                store.place(block, Tier.CPU, ready=True)
            store.drop_copy(block, Tier.GPU)
        return [block.block_id for block in blocks[:2]]

    first_ids = finish_turn(1)
    assert policy.state().t1 == tuple(first_ids)
    # Both CPU copies are evicted: nobody references them, so the blocks are forgotten.
    with store.victims(Tier.CPU, droppable_only=True) as victims:
        for _ in range(2):
            victim = victims.next()
            assert victim is not None
            store.drop_copy(victim, Tier.CPU)
    assert all(block_id not in store.blocks for block_id in first_ids)
    assert len(policy.state().b1) == 2
    # The same prompt again: no hit, computed again under new block ids, stored again.
    second_ids = finish_turn(2)
    assert set(second_ids).isdisjoint(first_ids)
    assert policy.state().b1 == () and policy.state().target_t1_blocks == 2.0
    # A third request finds them on the CPU and reuses them: frequent now.
    hits = store.open_sequence(3, prompt)
    assert [block.block_id for block in hits] == second_ids
    assert policy.state().t2 == tuple(second_ids)
    store.check_integrity()


# ------------------------------------------------------------------ invariants, randomized


@pytest.mark.parametrize("seed", range(20))
def test_random_calls_keep_the_invariants_and_every_victim_obeys_the_rules(seed: int) -> None:
    rng = random.Random(seed)
    policy = arc(rng.choice([Tier.GPU, Tier.CPU]))
    holding: dict[BlockKey, BlockFacts] = {}
    contents = [f"c{index}" for index in range(12)]  # few contents: ghosts hit often
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not holding:
            key, name = f"k{next_id}", rng.choice(contents)
            next_id += 1
            state = facts(
                name, referenced=rng.random() < 0.3, running=rng.random() < 0.1,
                busy=rng.random() < 0.2, ready_above=rng.random() < 0.3,
                lost=rng.random() < 0.05,
            )  # fmt: skip
            policy.insert(key, state)
            holding[key] = state
        elif op < 0.55:
            key = rng.choice(list(holding))
            old = holding[key]
            state = old._replace(
                referenced=rng.random() < 0.5, busy=rng.random() < 0.2,
                running=rng.random() < 0.1, ready_above=rng.random() < 0.3,
            )  # fmt: skip
            policy.update(key, state)
            holding[key] = state
        elif op < 0.65:
            policy.touch(rng.sample(list(holding), k=min(3, len(holding))))
        elif op < 0.72:
            key = rng.choice(list(holding))
            policy.remove(key)
            del holding[key]
        else:
            n = rng.randint(0, 3)
            protected = set(rng.sample(list(holding), k=min(len(holding), rng.randint(0, 2))))
            droppable_only = rng.random() < 0.3
            before = policy.state()
            victims = policy.evict(n, protected, droppable_only=droppable_only)
            if victims is None:
                assert policy.state() == before, "a failed evict changed the lists"
                eligible = [
                    k for k, f in holding.items()
                    if f.may_leave and k not in protected and (f.droppable or not droppable_only)
                ]  # fmt: skip
                assert len(eligible) < n
            else:
                assert len(victims) == n == len(set(victims))
                for key in victims:
                    state = holding.pop(key)
                    assert state.may_leave and key not in protected
                    assert state.droppable or not droppable_only
        assert policy.num_candidates() == sum(f.may_leave for f in holding.values())
        policy.check_integrity(set(holding))
