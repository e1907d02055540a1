"""Cost of one eviction decision with 100,000 GPU blocks in the residency policy.

A decision = evict the cheapest least-recently-used victim, then (to keep the
population constant) put it back and touch it. Every call of kvswap's policy
is O(1), so the figure must not grow with the number of blocks: it is measured
at 1,000 and 100,000 blocks side by side and their ratio is printed. The
policy is driven alone, with the facts the store would hand it.
"""

from __future__ import annotations

import time

from kvswap.base.eviction_policy import BlockFacts, EvictionPolicy, PolicyOptions
from kvswap.base.tier import Tier
from kvswap.control.policy import build_policy


def populate(num_blocks: int) -> tuple[EvictionPolicy, list[BlockFacts]]:
    policy = build_policy(Tier.GPU, PolicyOptions())
    facts = []
    for block_id in range(num_blocks):
        # Referenced by a paused sequence (2 in 3) or not; a copy below (1 in 2) or not.
        state = BlockFacts(
            referenced=block_id % 3 > 0, running=False, sink=False, busy=False,
            clean=block_id % 2 == 1, ready_above=False, lost=False,
        )  # fmt: skip
        facts.append(state)
        policy.insert(block_id, state)
    return policy, facts


def us_per_decision(num_blocks: int, decisions: int = 200_000) -> float:
    policy, facts = populate(num_blocks)
    start_s = time.perf_counter()
    for step in range(decisions):
        victims = policy.evict(1)
        assert victims is not None
        (victim,) = victims
        policy.advance(step)
        policy.update(victim, facts[victim])  # type: ignore[index]
        policy.touch(victims)
    return (time.perf_counter() - start_s) / decisions * 1e6


def section_policy_cost() -> dict[str, float]:
    small = us_per_decision(1_000)
    large = us_per_decision(100_000)
    return {
        "policy_us_per_decision_1k_blocks": small,
        "policy_us_per_decision_100k_blocks": large,
        "policy_cost_ratio_100k_vs_1k": large / small,
    }


if __name__ == "__main__":
    import json

    report = section_policy_cost()
    for key, value in report.items():
        print(f"  {key:<36} {value:.3f}")
    print(json.dumps(report))
