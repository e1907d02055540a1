"""The NVMe slab as a keyed `SecondaryTier` on its own: no engine, no HostPool; a 2-D
memoryview over a bytearray is the host pool, a 4-slot slab file in tmp_path the tier.
Narrated on tiny pools: bytes round trip, a corrupt or misplaced value is a miss, and
a full slab evicts its least recently used key for a newer one."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvswap.base.tier import Tier
from kvswap.control.policy import named_policy
from kvswap.data.disk_pool import DiskPool
from kvswap.data.tiers.base import JobResult, TransferJob
from kvswap.data.tiers.nvme_tier import NvmeTier
from kvswap.errors import ConfigError

BLOCK_BYTES = 4096
NUM_HOST_SLOTS = 8
NUM_NVME_SLOTS = 4


def keys_of(count: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"nvme-key-{i}".encode()).digest() for i in range(count))


KEYS = keys_of(8)


@pytest.fixture
def buffer() -> bytearray:
    """The host pool's bytes: NUM_HOST_SLOTS blocks of random data."""
    data = np.random.default_rng(3).integers(0, 256, NUM_HOST_SLOTS * BLOCK_BYTES, np.uint8)
    return bytearray(data.tobytes())


@pytest.fixture
def host(buffer: bytearray) -> memoryview:
    """The host pool as the tier is handed it: [NUM_HOST_SLOTS, BLOCK_BYTES], a 2-D memoryview."""
    return memoryview(buffer).cast("B", (NUM_HOST_SLOTS, BLOCK_BYTES))


def block(buffer: bytes | bytearray, slot: int) -> bytes:
    return bytes(buffer[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES])


@pytest.fixture
def open_tier(tmp_path: Path, host: memoryview) -> Iterator[Callable[..., NvmeTier]]:
    tiers: list[NvmeTier] = []

    def open_one(eviction_policy: str = "kvswap", **options: object) -> NvmeTier:
        disk = DiskPool(tmp_path, BLOCK_BYTES, NUM_NVME_SLOTS)
        policy = named_policy(Tier.NVME, eviction_policy)
        tiers.append(NvmeTier(host, disk, policy=policy, **options))  # type: ignore[arg-type]
        return tiers[-1]

    yield open_one
    for tier in tiers:
        tier.close()


Keys = tuple[bytes, ...]


def store(tier: NvmeTier, job_id: int, keys: Keys, slots: tuple[int, ...]) -> JobResult:
    tier.submit_store(TransferJob(job_id, keys, slots, is_load=False))
    return tier.wait(job_id)


def load(tier: NvmeTier, job_id: int, keys: Keys, slots: tuple[int, ...]) -> JobResult:
    tier.submit_load(TransferJob(job_id, keys, slots, is_load=True))
    return tier.wait(job_id)


def test_blocks_round_trip_exactly(open_tier: Callable[..., NvmeTier], buffer: bytearray) -> None:
    tier = open_tier()
    original = bytes(buffer)
    assert store(tier, 1, KEYS[:3], (0, 1, 2)).success
    again = store(tier, 2, KEYS[:1], (5,))  # held already: nothing is written
    assert again.success and tier.counters()["already_present"] == 1
    assert tier.lookup(KEYS[:3]) == 3 and tier.lookup(KEYS[1:4]) == 2 and tier.lookup(()) == 0

    buffer[5 * BLOCK_BYTES :] = bytes(3 * BLOCK_BYTES)
    loaded = load(tier, 3, KEYS[:3], (7, 5, 6))
    assert loaded.success and loaded.successful_keys == KEYS[:3]
    assert loaded.transfer_bytes == 3 * BLOCK_BYTES
    for slot, source in ((7, 0), (5, 1), (6, 2)):
        assert block(buffer, slot) == block(original, source)
    counters = tier.counters()
    assert (counters["written_blocks"], counters["hits_blocks"], counters["misses_blocks"]) == (
        3, 3, 0,
    )  # fmt: skip
    tier.check_integrity()


def test_a_corrupt_value_and_a_value_in_the_wrong_slot_are_misses(
    open_tier: Callable[..., NvmeTier], buffer: bytearray
) -> None:
    tier = open_tier()
    original = bytes(buffer)
    assert store(tier, 1, KEYS[:3], (0, 1, 2)).success
    stride = tier.disk.slot_stride_bytes
    slots = [tier.slot_of(key) for key in KEYS[:3]]
    assert None not in slots
    with open(tier.disk.path, "r+b") as slab:
        slab.seek(slots[0] * stride + 100)  # type: ignore[operator]
        slab.write(bytes([original[100] ^ 0xFF]))  # one bit-flipped byte
        slab.seek(slots[1] * stride)  # type: ignore[operator]
        slab.write(block(original, 2))  # key 2's intact bytes
        slab.flush()
        os.fsync(slab.fileno())

    result = load(tier, 2, (*KEYS[:3], KEYS[7]), (4, 5, 6, 7))
    assert not result.success and result.successful_keys == KEYS[2:3]
    assert result.error == "checksum x2, missing x1"
    assert block(buffer, 6) == block(original, 2)
    counters = tier.counters()
    assert (counters["corrupt_blocks"], counters["misses_blocks"], counters["hits_blocks"]) == (
        2, 1, 1,
    )  # fmt: skip
    # Both bad values are dropped: misses from now on, their slots free for newer blocks.
    assert tier.lookup(KEYS[:1]) == 0 and tier.slot_of(KEYS[1]) is None and tier.num_keys == 1
    tier.check_integrity()


@pytest.mark.parametrize("policy", ["kvswap", "lru"])
def test_a_full_slab_evicts_its_least_recently_used_key(
    open_tier: Callable[..., NvmeTier], policy: str
) -> None:
    tier = open_tier(eviction_policy=policy)
    for i in range(6):  # six blocks through four slots, one job each
        assert store(tier, i, KEYS[i : i + 1], (i,)).success
    # The two oldest made room for the two newest: capacity respected, newest kept.
    assert tier.num_keys == NUM_NVME_SLOTS and tier.counters()["evicted_blocks"] == 2
    assert [tier.lookup(KEYS[i : i + 1]) for i in range(6)] == [0, 0, 1, 1, 1, 1]
    assert load(tier, 10, KEYS[:1], (7,)).error == "missing x1"

    # Reading key 2 makes it the most recently used: key 3 goes for the next block.
    assert load(tier, 11, KEYS[2:3], (7,)).success
    assert store(tier, 12, KEYS[6:7], (6,)).success
    assert [tier.lookup(KEYS[i : i + 1]) for i in range(2, 7)] == [1, 0, 1, 1, 1]
    tier.check_integrity()


def test_a_local_slab_says_which_keys_it_evicted_once(
    open_tier: Callable[..., NvmeTier],
) -> None:
    """kvswap's engine's own slab (`local`) keeps its victims' keys until asked; one
    opened for vLLM or SGLang (not local) keeps none."""
    tier, shared = open_tier(local=True), open_tier()
    assert tier.local and not shared.local
    for i in range(6):
        assert store(tier, i, KEYS[i : i + 1], (i,)).success
        assert store(shared, i, KEYS[i : i + 1], (i,)).success
    assert list(tier.evicted_keys()) == list(KEYS[:2]) and list(tier.evicted_keys()) == []
    assert list(shared.evicted_keys()) == [] and shared.counters()["evicted_blocks"] == 2


def test_a_key_being_written_is_never_a_victim(
    open_tier: Callable[..., NvmeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(num_write_lanes=2)
    for i in range(3):
        assert store(tier, i, KEYS[i : i + 1], (i,)).success
    entered, release = threading.Event(), threading.Event()
    write_slot = tier.disk.write_slot

    def gated_write(slot: int, src: memoryview) -> None:
        entered.set()
        assert release.wait(timeout=60)
        write_slot(slot, src)

    monkeypatch.setattr(tier.disk, "write_slot", gated_write)
    tier.submit_store(TransferJob(3, KEYS[3:4], (3,), is_load=False))  # the last free slot
    assert entered.wait(timeout=60)
    monkeypatch.setattr(tier.disk, "write_slot", write_slot)
    # Keys 0..2 are ready (victims), key 3 is being written (not one).
    for i in range(4, 7):
        assert store(tier, i, KEYS[i : i + 1], (i,)).success
    assert tier.lookup(KEYS[3:4]) == 0  # not found while being written
    release.set()
    assert tier.wait(3).success
    assert [tier.lookup(KEYS[i : i + 1]) for i in range(7)] == [0, 0, 0, 1, 1, 1, 1]
    tier.check_integrity()


@pytest.mark.parametrize("policy", ["kvswap", "lru"])
def test_a_held_key_is_never_a_victim_until_its_last_release(
    open_tier: Callable[..., NvmeTier], policy: str
) -> None:
    """The only copy of a paused sequence's block: held, it outlives every newer store;
    a hold taken before the store lands holds too; with every key held, a store fails."""
    tier = open_tier(eviction_policy=policy)
    assert tier.holds_keys
    tier.hold(KEYS[:1] * 2)  # twice: two releases to let it go
    tier.hold(KEYS[1:2])  # before its store
    for i in range(6):
        assert store(tier, i, KEYS[i : i + 1], (i,)).success
    assert [tier.lookup(KEYS[i : i + 1]) for i in range(6)] == [1, 1, 0, 0, 1, 1]
    tier.hold(KEYS[4:6])
    refused = store(tier, 6, KEYS[6:7], (6,))  # four keys, four holds: no victim
    assert not refused.success
    assert refused.error == "full: every key is being read, written or held x1"
    assert tier.counters()["no_room_blocks"] == 1 and tier.num_held_keys == 4
    tier.check_integrity()

    tier.release(KEYS[:1])  # one hold of two left
    assert not store(tier, 7, KEYS[6:7], (6,)).success
    tier.release(KEYS[:1])
    assert store(tier, 8, KEYS[6:7], (6,)).success and tier.lookup(KEYS[:1]) == 0
    with pytest.raises(ValueError, match="not held"):
        tier.release(KEYS[:1])
    with pytest.raises(ValueError, match="not held"):
        tier.release(KEYS[1:2] * 2)  # one hold, two releases: nothing released
    assert tier.num_held_keys == 3
    tier.check_integrity()


def test_wrong_options_are_one_line_errors(tmp_path: Path, host: memoryview) -> None:
    with pytest.raises(ConfigError) as unknown:
        named_policy(Tier.NVME, "fifo")
    assert "nvme_eviction_policy = 'fifo'" in str(unknown.value)
    assert "\n" not in str(unknown.value)
    policy = named_policy(Tier.NVME, "kvswap")
    other = DiskPool(tmp_path, 2 * BLOCK_BYTES, NUM_NVME_SLOTS)
    with other, pytest.raises(ValueError, match="must match"):
        NvmeTier(host, other, policy=policy)
    with pytest.raises(ValueError, match="2-D uint8"):
        NvmeTier(memoryview(bytearray(BLOCK_BYTES)), other, policy=policy)
