"""`is_ancestor`: the jump pointers answer as a walk down the chain does, in few steps."""

from __future__ import annotations

import random

from kvswap.control.blocks import Block, is_ancestor


def walk_is_ancestor(ancestor: Block, block: Block) -> bool:
    node = block.parent
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def test_jump_pointers_answer_as_the_walk_does_on_a_branching_tree() -> None:
    rng = random.Random(7)
    blocks = [Block(block_id=0, parent_key=b"root")]
    for block_id in range(1, 1500):
        # Mostly long chains (a conversation growing), sometimes a branch off any block.
        parent = blocks[-1] if rng.random() < 0.9 else rng.choice(blocks)
        blocks.append(Block(block_id=block_id, parent_key=b"k", parent=parent))
    assert blocks[1].depth == 1 and blocks[0].depth == 0
    for _ in range(20_000):
        a, b = rng.choice(blocks), rng.choice(blocks)
        assert is_ancestor(a, b) == walk_is_ancestor(a, b), (a.block_id, b.block_id)
    for block in blocks:
        assert not is_ancestor(block, block)  # a block is not its own prefix


def test_a_deep_chain_is_asked_in_logarithmic_steps() -> None:
    chain = [Block(block_id=0, parent_key=b"root")]
    for block_id in range(1, 1 << 14):
        chain.append(Block(block_id=block_id, parent_key=b"k", parent=chain[-1]))
    tip, steps = chain[-1], 0
    node = tip.parent
    assert node is not None
    while node.depth > 3:  # the walk `is_ancestor` makes towards depth 3
        jump = node.jump
        assert jump is not None and node.parent is not None
        node = jump if jump.depth >= 3 else node.parent
        steps += 1
    assert node is chain[3] and is_ancestor(chain[3], tip)
    assert steps <= 3 * 14  # O(log depth), against 16,380 steps for the walk
