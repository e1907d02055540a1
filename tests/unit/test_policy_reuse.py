"""The reuse ranking (control/policy_reuse.py), narrated on a tier of a few copies.

Requests come and go as the adapters report them: a copy stored by a running request
is inserted referenced; the request's end releases it; a later request taking it
again is a reuse (referenced rises). The clock is `advance`'s step."""

from __future__ import annotations

import random

import pytest

from kvswap.base.eviction_policy import BlockFacts, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.config_load import load_config
from kvswap.control.policy import build_policy, check_policy_names
from kvswap.control.policy_reuse import DEAD_GAPS, ReusePolicy
from kvswap.control.store import BlockStore
from kvswap.control.store_records import StoreLayout
from kvswap.drive.settings import policy_options
from kvswap.errors import ConfigError
from tests.unit.test_eviction_policies import drain, facts

HELD = facts()  # referenced by a running request (its blocks are on the device)
FREE = facts(referenced=False)  # nobody references it: a cache entry
SINK = facts(sink=True)  # among a running request's first blocks
BUSY = facts(busy=True)


def reuse_policy(name: str = "reuse") -> ReusePolicy:
    policy = build_policy(Tier.CPU, PolicyOptions(cpu_eviction_policy=name))
    assert isinstance(policy, ReusePolicy)
    return policy


def turn(policy: ReusePolicy, step: int, keys: list[str], stored: list[str]) -> None:
    """One request at `step`: it reuses `keys` (held, then released) and stores `stored`."""
    policy.advance(step)
    for key in keys:
        policy.update(key, HELD)
    for key in stored:
        policy.insert(key, HELD)
    for key in [*keys, *stored]:
        policy.update(key, FREE)


def test_of_two_sessions_that_ended_a_turn_the_earlier_comes_back_first() -> None:
    """Session a ended its turn at step 10, b at step 20; both will come back a think
    time after: b's blocks are needed last, so they go first (an LRU evicts a's)."""
    policy = reuse_policy()
    turn(policy, 10, [], ["a0", "a1"])
    turn(policy, 20, [], ["b0", "b1"])
    assert sorted(policy.evict(2) or []) == ["b0", "b1"]  # the newest first
    assert sorted(drain(policy)) == ["a0", "a1"]


def test_a_running_request_s_fresh_blocks_go_before_a_finished_session_s() -> None:
    """The device holds a running request's blocks; its next turn is the furthest away."""
    policy = reuse_policy()
    turn(policy, 10, [], ["done0"])
    policy.advance(20)
    policy.insert("running0", HELD)
    assert policy.evict(1) == ["running0"]


def test_what_requests_reuse_stays_and_the_shared_prefix_longest() -> None:
    """A system prompt reused every few steps is predicted back soonest; a session's
    context reused once a turn later; a block used once goes before both."""
    policy = reuse_policy()
    turn(policy, 0, [], ["system", "ctx"])
    for step in (5, 10, 15):
        turn(policy, step, ["system"], [])
    turn(policy, 30, ["ctx"], [])  # its session came back after 30 steps
    turn(policy, 31, [], ["once"])
    assert drain(policy) == ["once", "ctx", "system"]


def test_a_session_idle_past_the_dead_line_goes_first_oldest_first() -> None:
    """First reuses come 30 steps after a store: a copy idle for DEAD_GAPS x 30 steps is
    a session that ended, and goes before any live one, however old or reused."""
    policy = reuse_policy()
    turn(policy, 0, [], ["gone0", "gone1", "live"])
    turn(policy, 30, ["gone0", "gone1", "live"], [])  # the gap is 30 steps
    turn(policy, 31, [], ["fresh"])
    quiet_step = 30 + round(DEAD_GAPS * 30) + 1
    turn(policy, quiet_step, ["live"], [])  # live is used again; gone0/gone1 are not
    policy.advance(quiet_step + 1)
    assert policy.evict(2) == ["gone0", "gone1"]
    assert drain(policy) == ["fresh", "live"]


def test_quick_re_references_do_not_make_a_waiting_session_dead() -> None:
    """Nine copies taken up again 2 steps after they arrived (a prefix between two
    requests) and one session back after 100 steps: the return gap is the session's,
    so a session idle 60 steps is waiting, not dead (a median gap would call it dead
    after a few steps), and the newest goes first as usual."""
    policy = reuse_policy()
    for index in range(9):
        step = 10 * index
        turn(policy, step, [], [f"prefix{index}"])
        turn(policy, step + 2, [f"prefix{index}"], [])
        policy.remove(f"prefix{index}")  # only its gap stays
    turn(policy, 0, [], ["back"])
    turn(policy, 100, ["back"], [])
    turn(policy, 101, [], ["waiting"])
    turn(policy, 110, [], ["newer"])
    policy.advance(161)  # "waiting" idle 60 steps: past 1.5 quick gaps, not 1.5 returns
    assert policy.evict(1) == ["newer"]
    policy.advance(101 + round(DEAD_GAPS * 100) + 1)
    # Idle past 1.5 return gaps: dead, the oldest first (the session back at step 100 too).
    assert policy.evict(2) == ["back", "waiting"]


def test_a_sink_used_once_outranks_other_blocks_used_once_not_reused_ones() -> None:
    policy = reuse_policy()
    turn(policy, 0, [], ["reused"])
    turn(policy, 5, ["reused"], [])
    policy.advance(6)
    policy.insert("sink", SINK)
    policy.insert("plain", HELD)
    assert drain(policy) == ["plain", "sink", "reused"]


def test_the_hard_rule_protected_droppable_and_all_or_nothing() -> None:
    policy = reuse_policy()
    policy.insert("busy", BUSY)
    policy.insert("held", HELD)  # referenced, dirty: not droppable
    policy.insert("free", FREE)
    assert policy.num_candidates() == 2
    assert policy.evict(3) is None and policy.num_candidates() == 2  # nothing changed
    assert policy.evict(1, protected={"held", "free"}) is None
    assert policy.evict(2, droppable_only=True) is None
    assert policy.evict(1, droppable_only=True) == ["free"]
    policy.update("busy", FREE)  # its transfer ended
    assert sorted(drain(policy)) == ["busy", "held"]
    policy.check_integrity(set())


def test_random_calls_keep_the_books_and_never_hand_out_what_may_not_leave() -> None:
    """Many updates leave stale heap entries behind: each victim is live, may leave and
    is handed out once; the counts and the heaps agree throughout."""
    rng = random.Random(5)
    policy = reuse_policy()
    held: dict[str, BlockFacts] = {}
    states = [HELD, FREE, SINK, BUSY, facts(referenced=False, clean=True)]
    for step in range(3000):
        policy.advance(step // 4)
        key = f"k{rng.randrange(60)}"
        action = rng.random()
        if action < 0.6:
            state = rng.choice(states)
            (policy.update if key in held else policy.insert)(key, state)
            held[key] = state
        elif action < 0.7:
            policy.touch([key])
        elif action < 0.8 and key in held:
            policy.remove(key)
            del held[key]
        else:
            n = rng.randrange(1, 4)
            victims = policy.evict(n)
            may_leave = [k for k, f in held.items() if f.may_leave]
            if victims is None:
                assert len(may_leave) < n
                continue
            assert len(set(victims)) == n and all(held[v].may_leave for v in victims)
            for victim in victims:
                del held[victim]
        assert policy.num_candidates() == sum(f.may_leave for f in held.values())
        policy.check_integrity(set(held))


def test_a_key_removed_and_inserted_again_leaves_no_stale_entry_alive() -> None:
    """Regression: versions restarted per key, so a key taken out and put back (the
    store returns a victim it could not use) revived its old heap entries: one key held
    thousands of live duplicates and the simulator slowed to a crawl."""
    policy = reuse_policy()
    for step in range(200):
        policy.advance(step)
        policy.insert("k", FREE)
        assert policy.evict(1) == ["k"]
    policy.insert("k", FREE)
    version = policy._held["k"].version
    assert [e for heap in policy._heaps for e in heap if e[1:] == (version, "k")] == [
        e for heap in policy._heaps for e in heap if e[2] == "k" and e[1] == version
    ] and sum(e[1:] == (version, "k") for heap in policy._heaps for e in heap) == 1
    assert policy.evict(1) == ["k"] and policy.evict(1) is None


def test_copies_that_may_not_leave_have_no_entry_for_evict_to_look_past() -> None:
    """Regression: a copy that may not leave (a running sequence's on the device, one
    under transfer) kept its heap entries, and every `evict` popped and pushed back each
    of them: on a device tier of running sequences each victim cost a scan of the tier
    (the simulator with `gpu_eviction_policy = "reuse"` took over 100 s for 90 requests
    of sim_scale.py's trace, 2 s without the scan)."""
    policy = reuse_policy()
    for index in range(1000):
        policy.insert(f"r{index}", facts(running=True))  # the class evicted first
    policy.insert("busy", BUSY)
    policy.insert("free", FREE)
    assert sum(map(len, policy._heaps)) + len(policy._idle) == 2  # "free"'s two only
    assert policy.evict(1) == ["free"]
    policy.update("r7", HELD)  # its sequence paused: it may leave now
    policy.update("busy", FREE)  # its transfer ended
    assert sorted(drain(policy)) == ["busy", "r7"]
    policy.check_integrity({f"r{index}" for index in range(1000)})


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.CPU, Tier.NVME])
def test_reuse_is_a_built_in_name_on_every_tier(tier: Tier) -> None:
    options = PolicyOptions(gpu_eviction_policy="reuse", cpu_eviction_policy="reuse",
                            nvme_eviction_policy="reuse")  # fmt: skip
    assert isinstance(build_policy(tier, options), ReusePolicy)


def test_once_oldest_evicts_the_once_used_oldest_first_and_nothing_else_moves() -> None:
    """`reuse(once=oldest)`: of two sessions that ended a turn, the earlier goes first
    (an LRU's order within the class); a running request's blocks still go before them."""
    policy = reuse_policy("reuse(once=oldest)")
    turn(policy, 10, [], ["a0", "a1"])
    turn(policy, 20, [], ["b0", "b1"])
    policy.insert("running0", HELD)
    assert policy.evict(1) == ["running0"]
    assert sorted(policy.evict(2) or []) == ["a0", "a1"]
    assert sorted(drain(policy)) == ["b0", "b1"]


def test_dead_gaps_moves_the_dead_line() -> None:
    """With the line at 1 return gap, a copy idle 32 steps after 30-step gaps is dead
    and goes before a newer live one; with the default 1.5 it is not yet."""
    for name, first in (("reuse(dead_gaps=1)", "gone"), ("reuse", "fresh")):
        policy = reuse_policy(name)
        turn(policy, 0, [], ["gone", "live"])
        turn(policy, 30, ["gone", "live"], [])  # the return gap is 30 steps
        turn(policy, 40, [], ["fresh"])
        turn(policy, 61, ["live"], [])
        policy.advance(62)  # gone idle 32 steps
        assert policy.evict(1) == [first], name


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("reuse(once=middle)", "once = 'middle': allowed: 'newest' (the default) or 'oldest'"),
        ("reuse(dead_gaps=0)", "dead_gaps = '0': allowed: a number of return gaps > 0"),
        ("reuse(dead_gaps=inf)", "dead_gaps = 'inf': allowed: a number of return gaps > 0"),
        ("reuse(dead_gaps=x)", "dead_gaps = 'x': allowed: a number of return gaps > 0"),
        ("reuse(onse=oldest)", "reuse takes no parameter 'onse'; allowed: once, dead_gaps"),
        ("lru(once=oldest)", "lru takes no parameter 'once'; allowed: none"),
        ("reuse(once=oldest", "not a policy with parameters; allowed: NAME(key=value, ...)"),
        ("reuse(once)", "not a policy with parameters"),
        ("reuse(once=oldest, once=newest)", "each key once"),
        ("(once=oldest)", "not a policy with parameters"),
        ("mru(once=oldest)", "'mru(once=oldest)': unknown policy"),
    ],
)
def test_a_parameter_the_policy_cannot_read_is_one_config_error(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_policy_names(PolicyOptions(cpu_eviction_policy=value))
    message = str(caught.value)
    assert message.startswith(f"cpu_eviction_policy = {value!r}: ") and says in message
    assert "\n" not in message


def test_parameters_reach_the_policy_from_the_config_and_spaces_are_allowed() -> None:
    value = "reuse( once = oldest ,dead_gaps=2 )"
    config = load_config(None, overrides={"cpu_eviction_policy": value})
    options = policy_options(config)
    policy = BlockStore(StoreLayout(4, 4, 4, 0), options).policies[Tier.CPU]
    assert isinstance(policy, ReusePolicy)
    assert policy.options.parameters == (("once", "oldest"), ("dead_gaps", 2.0))
    assert (policy._once_oldest, policy._dead_gaps) == (True, 2.0)
    assert reuse_policy("reuse()").options.parameters == ()
