"""`TierList`: secondary tiers stacked as one (stores to each, loads falling through)."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from kvswap.base.tier import Tier
from kvswap.control.policy import named_policy
from kvswap.data.disk_pool import DiskPool
from kvswap.data.tiers.base import HostSlots, TransferJob
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.nvme_tier import NvmeTier
from kvswap.data.tiers.tier_list import TierList
from tests.unit.dict_tier_support import DictTier

BLOCK_BYTES = 32
KEYS = tuple(hashlib.sha256(f"list-{i}".encode()).digest() for i in range(4))


def host_slots() -> HostSlots:
    return (np.arange(6 * BLOCK_BYTES) % 251).astype(np.uint8).reshape(6, BLOCK_BYTES)


def value(n: int) -> bytes:
    return bytes([n]) * BLOCK_BYTES


def store(job_id: int, slots: tuple[int, ...]) -> TransferJob:
    return TransferJob(job_id, KEYS[: len(slots)], slots, is_load=False)


def load(job_id: int, slots: tuple[int, ...]) -> TransferJob:
    return TransferJob(job_id, KEYS[: len(slots)], slots, is_load=True)


def test_a_store_reaches_every_tier_and_counters_add_up() -> None:
    host = host_slots()
    upper, lower = DictTier(host, {}), DictTier(host, {}, deferred=True)
    tiers = TierList([upper, lower])
    tiers.submit_store(store(1, (0, 1)))
    (result,) = tiers.get_finished_jobs()
    assert result.success and result.successful_keys == KEYS[:2]
    assert result.transfer_bytes == 4 * BLOCK_BYTES  # two blocks, two tiers
    for tier in (upper, lower):
        assert tier.values == {KEYS[0]: host[0].tobytes(), KEYS[1]: host[1].tobytes()}
    assert tiers.lookup(KEYS) == 2
    tiers.submit_load(load(2, (4, 5)))
    assert tiers.wait(2).success
    assert tiers.counters() == {"loaded_blocks": 2, "tier0_loaded_blocks": 2,
                                "tier1_loaded_blocks": 0}  # fmt: skip


def test_a_load_falls_through_to_the_first_tier_holding_each_key() -> None:
    host = host_slots()
    upper = DictTier(host, {KEYS[0]: value(10), KEYS[1]: value(11)})
    upper.corrupt.add(KEYS[1])  # held, but fails its check: the tier below has it
    lower = DictTier(host, {KEYS[1]: value(21), KEYS[2]: value(22)}, deferred=True)
    tiers = TierList([upper, lower])
    assert upper.lookup(KEYS) == 2 and lower.lookup(KEYS) == 0
    asked: list[tuple[str, int]] = []
    for name, tier in (("upper", upper), ("lower", lower)):
        answer = tier.lookup
        tier.lookup = lambda keys, name=name, answer=answer: (  # type: ignore[method-assign]
            asked.append((name, KEYS.index(keys[0]))) or answer(keys)
        )
    assert tiers.lookup(KEYS) == 3  # k0, k1 above; k1, k2 below: held, each, by some tier
    # Each tier is asked where the keys found so far end, never again where it said no.
    assert asked == [("upper", 0), ("lower", 2), ("upper", 3)]
    tiers.submit_load(load(7, (0, 1, 2, 3)))
    result = tiers.wait(7)
    assert not result.success and result.successful_keys == KEYS[:3]
    assert result.error == "1 of 4 keys loaded by no tier"
    assert [bytes(host[slot]) for slot in (0, 1, 2)] == [value(10), value(21), value(22)]
    # The tier below was asked only for what the tier above did not load.
    assert [job.keys for job in lower.jobs_seen] == [KEYS[1:4]]
    assert tiers.get_finished_jobs() == []  # reported by `wait`, never again
    with pytest.raises(ValueError, match="not pending"):
        tiers.wait(7)


def test_drain_finishes_loads_that_go_on_to_a_later_tier() -> None:
    host = host_slots()
    upper = DictTier(host, {}, deferred=True)
    lower = DictTier(host, {KEYS[0]: value(30)}, deferred=True)
    tiers = TierList([upper, lower])
    tiers.submit_load(load(3, (2,)))
    tiers.drain()  # the tier above misses; the load goes on below and finishes
    assert [len(tier.jobs_seen) for tier in (upper, lower)] == [1, 1]
    (result,) = tiers.get_finished_jobs()
    assert result.success and bytes(host[2]) == value(30)


def test_a_tier_that_is_down_is_skipped_and_none_usable_fails_at_once() -> None:
    host = host_slots()
    upper, lower = DictTier(host, {KEYS[0]: value(1)}), DictTier(host, {KEYS[0]: value(2)})
    upper.down = True
    tiers = TierList([upper, lower])
    assert tiers.available and tiers.lookup(KEYS[:1]) == 1
    tiers.submit_load(load(1, (0,)))
    assert tiers.wait(1).success and bytes(host[0]) == value(2)
    assert upper.jobs_seen == []  # never asked while down
    lower.down = True
    assert not tiers.available and tiers.lookup(KEYS) == 0
    tiers.submit_store(store(2, (1, 2)))
    (result,) = tiers.get_finished_jobs()
    assert result.successful_keys == () and result.error == "2 of 2 keys stored by no tier"


def test_wrong_use_is_a_one_line_value_error() -> None:
    host = host_slots()
    with pytest.raises(ValueError, match="at least one tier"):
        TierList([])
    with pytest.raises(ValueError, match="tier 1 \\(DictTier\\) is built over other host slots"):
        TierList([DictTier(host, {}), DictTier(host_slots(), {})])
    upper, lower = DictTier(host, {}, deferred=True), DictTier(host, {})
    tiers = TierList([upper, lower])
    tiers.submit_store(store(1, (0,)))
    with pytest.raises(ValueError, match="job 1: id already in use"):
        tiers.submit_load(load(1, (1,)))
    with pytest.raises(ValueError, match="leave"):
        tiers.submit_load(load(2, (6,)))
    tiers.close()
    assert upper.closed and lower.closed
    with pytest.raises(ValueError, match="closed"):
        tiers.submit_store(store(3, (0,)))


def test_threads_that_each_wait_for_their_own_jobs_get_their_own_results(tmp_path: Path) -> None:
    """SGLang's pattern: several threads submit jobs and wait for their own; a page the
    slab in front lacks comes from the tier behind it. Two NVMe slabs here, with lanes."""
    host = np.zeros((16, BLOCK_BYTES), np.uint8)
    front_dir, back_dir = tmp_path / "front", tmp_path / "back"
    front_dir.mkdir(), back_dir.mkdir()
    tiers = [NvmeTier(host, DiskPool(directory, BLOCK_BYTES, 64), policy=named_policy(
        Tier.NVME, "lru")) for directory in (front_dir, back_dir)]  # fmt: skip
    keys = [hashlib.sha256(f"thread-{i}".encode()).digest() for i in range(8)]
    with TierList(tiers) as listed:
        host[:8] = np.arange(8, dtype=np.uint8)[:, None] + 1
        listed.submit_store(TransferJob(1, tuple(keys[:4]), (0, 1, 2, 3), is_load=False))
        assert listed.wait(1).success  # keys 0-3 in both slabs
        tiers[1].submit_store(TransferJob(2, tuple(keys[4:]), (4, 5, 6, 7), is_load=False))
        assert tiers[1].wait(2).success  # keys 4-7 behind only
        host[:] = 0
        errors: list[BaseException] = []

        def load(thread: int) -> None:
            try:
                for round_ in range(20):
                    job_id = 100 + 20 * thread + round_
                    wanted = (keys[thread], keys[thread + 4])
                    slots = (8 + thread, 12 + thread)
                    listed.submit_load(TransferJob(job_id, wanted, slots, is_load=True))
                    assert listed.wait(job_id).success
                    assert bytes(host[slots[0]]) == bytes([thread + 1]) * BLOCK_BYTES
                    assert bytes(host[slots[1]]) == bytes([thread + 5]) * BLOCK_BYTES
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert tiers[1].counters()["hits_blocks"] == 4 * 20  # every key 4-7 fell through
    assert list(front_dir.iterdir()) == list(back_dir.iterdir()) == []


def test_holds_reach_each_tier_that_holds_keys_and_the_adapter_passes_them_on(
    tmp_path: Path,
) -> None:
    """A dict tier (no holds: the default) above an NVMe slab (holds): the list holds
    when one of its tiers does, and a hold or release reaches that tier alone."""
    host = host_slots()
    upper = DictTier(host, {})
    nvme = NvmeTier(host, DiskPool(tmp_path, BLOCK_BYTES, 4), policy=named_policy(Tier.NVME, "lru"))
    with TierCopyEngine(TierList([upper, nvme])) as engine:
        assert not upper.holds_keys and engine.holds_keys
        engine.hold(KEYS[:2])
        assert nvme.num_held_keys == 2
        engine.release(KEYS[:1])
        assert nvme.num_held_keys == 1
        with pytest.raises(ValueError, match="not held"):
            engine.release(KEYS[:1])
    assert not TierList([DictTier(host, {})]).holds_keys
