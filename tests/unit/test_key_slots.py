"""The NVMe slab's index by key (`KeySlots`): which key has which slot, and who leaves.

Torch-free, shared by kvswap's `NvmeTier` and the simulator's model of the slab;
each is tested through its own user too (test_nvme_tier.py, test_sim_remote.py).
"""

from __future__ import annotations

import pytest

from kvswap.base.key_slots import KeySlots, NoSlot
from kvswap.base.tier import Tier
from kvswap.control.policy import named_policy

A, B, C, D = (bytes([n]) * 32 for n in range(4))


def slots(num_slots: int, *, keep_evicted: bool = True) -> KeySlots:
    policy = named_policy(Tier.NVME, "lru", capacity_blocks=num_slots)
    return KeySlots(num_slots, policy, keep_evicted=keep_evicted)


def store(index: KeySlots, key: bytes) -> int | NoSlot:
    """A store of `key` that lands at once."""
    slot = index.claim(key)
    if isinstance(slot, int):
        index.written(key)
    return slot


def test_a_full_index_gives_its_least_recently_used_key_s_slot_and_says_so() -> None:
    index = slots(2)
    assert (store(index, A), store(index, B)) == (0, 1)
    assert store(index, A) is NoSlot.PRESENT  # a block never changes: nothing written
    assert index.begin_read(A) == 0
    index.end_read(A, good=True)  # A is now the most recently used
    assert store(index, C) == 1 and B not in index  # B's slot
    assert index.take_evicted() == [B] and index.take_evicted() == []
    assert index.lookup([A, C, B]) == 2 and index.num_evicted == 1
    index.check_integrity()


def test_a_key_being_written_read_or_held_is_never_a_victim() -> None:
    index = slots(2)
    assert index.claim(A) == 0  # being written
    store(index, B)
    assert index.begin_read(B) == 1  # being read
    assert index.claim(C) is NoSlot.FULL
    index.written(A)
    index.end_read(B, good=True)
    index.hold([A, B])
    index.hold([C])  # held before its store
    assert index.claim(C) is NoSlot.FULL and index.num_held_keys == 3
    index.release([B])
    assert store(index, C) == 1 and index.take_evicted() == [B]
    with pytest.raises(ValueError, match="not held"):
        index.release([B])
    index.check_integrity()


def test_a_value_that_failed_its_check_goes_with_its_last_reader() -> None:
    index = slots(2, keep_evicted=False)
    store(index, A)
    assert index.begin_read(A) == index.begin_read(A) == 0
    index.end_read(A, good=False)
    assert index.lookup([A]) == 0 and index.claim(A) is NoSlot.DROPPING
    index.end_read(A, good=True)  # the other reader: now it is dropped
    assert A not in index and store(index, A) == 0
    store(index, B)
    store(index, C)  # evicts A; not kept
    assert index.take_evicted() == [] and index.num_evicted == 1
    index.check_integrity()
