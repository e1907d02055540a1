"""Cost of one eviction decision with 100,000 GPU blocks in the residency policy.

A decision = pop the cheapest least-recently-used victim, then (to keep the
population constant) touch it and put it back. Every policy call is O(1), so
the figure must not grow with the number of blocks: it is measured at 1,000
and 100,000 blocks side by side and their ratio is printed.
"""

from __future__ import annotations

import time

from kvswap.control.blocks import Block, Copy
from kvswap.control.policy import PolicyOptions, ResidencyPolicy
from kvswap.control.transfer import Tier


def populate(num_blocks: int) -> tuple[ResidencyPolicy, list[Block]]:
    policy = ResidencyPolicy(PolicyOptions())
    blocks = []
    for block_id in range(num_blocks):
        block = Block(block_id=block_id, parent_key=bytes(32), ref_count=block_id % 3)
        block.copies[Tier.GPU] = Copy(slot=block_id)
        if block_id % 2:
            block.copies[Tier.CPU] = Copy(slot=block_id)
        blocks.append(block)
        policy.update(block)
    return policy, blocks


def us_per_decision(num_blocks: int, decisions: int = 200_000) -> float:
    policy, _ = populate(num_blocks)
    start_s = time.perf_counter()
    for step in range(decisions):
        victim = policy.pop_victim()
        assert victim is not None
        policy.advance(step)
        policy.update(victim)
        policy.touch(victim)
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
