"""The Redis store as a `SecondaryTier` on its own: no engine, no HostPool, no torch
tensors; a numpy array of 8 slots is the host pool, a real redis-server on loopback
the store. Jobs in, results out, exactly as a vLLM adapter will drive it."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import HEADER_BYTES, layout_fingerprint
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
from kvswap.data.tiers.base import JobResult, TransferJob
from kvswap.data.tiers.redis_tier import RedisTier

from ..redis_server import RedisServer

BLOCK_BYTES = 8192
NUM_SLOTS = 8
NAMESPACE = "tier-ns"
TIMEOUT_MS = 5000.0


def keys_of(count: int, salt: str = "") -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{salt}key-{i}".encode()).digest() for i in range(count))


def store_name(key: bytes) -> bytes:
    return f"{NAMESPACE}:{key.hex()}".encode()


@pytest.fixture
def host() -> np.ndarray:
    """[NUM_SLOTS, BLOCK_BYTES] uint8 of random bytes: the host pool as a tier sees it."""
    return np.random.default_rng(7).integers(0, 256, (NUM_SLOTS, BLOCK_BYTES), dtype=np.uint8)


@pytest.fixture
def open_tier(host: np.ndarray) -> Iterator[Callable[[str], RedisTier]]:
    """`open_tier(url)`: a RedisTier over `host`, closed when the test ends."""
    tiers: list[RedisTier] = []

    def open_one(url: str) -> RedisTier:
        client = RemoteStoreClient(
            parse_remote_url(url, {}), namespace=NAMESPACE, timeout_ms=TIMEOUT_MS
        )
        client.connect(required=True)
        fingerprint = layout_fingerprint(KVLayout.from_block_bytes(BLOCK_BYTES))
        tiers.append(RedisTier(client, host, layout_fingerprint=fingerprint))
        return tiers[-1]

    yield open_one
    for tier in tiers:
        tier.close()


def store(tier: RedisTier, job_id: int, keys: tuple[bytes, ...], slots: tuple[int, ...]) -> None:
    tier.submit_store(TransferJob(job_id, keys, slots, is_load=False))


def load(
    tier: RedisTier, job_id: int, keys: tuple[bytes, ...], slots: tuple[int, ...]
) -> JobResult:
    tier.submit_load(TransferJob(job_id, keys, slots, is_load=True))
    return tier.wait(job_id)


def test_blocks_round_trip_exactly_and_each_job_is_reported_once(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier], host: np.ndarray
) -> None:
    tier = open_tier(redis_server.url)
    original = host.copy()
    keys = keys_of(4)
    store(tier, 1, keys[:2], (0, 1))
    store(tier, 2, keys[2:], (2, 3))
    tier.drain()
    stored = tier.get_finished_jobs()
    assert [(r.job_id, r.success, r.successful_keys) for r in sorted(stored, key=id_of)] == [
        (1, True, keys[:2]),
        (2, True, keys[2:]),
    ]
    assert all(r.transfer_bytes == 2 * BLOCK_BYTES and r.error is None for r in stored)
    assert tier.get_finished_jobs() == []  # reported once
    assert tier.lookup(keys) == 4 and tier.lookup((keys_of(1, "absent")[0], *keys)) == 0

    host[4:] = 0
    loaded = load(tier, 3, keys, (7, 6, 5, 4))
    assert loaded.success and loaded.successful_keys == keys
    assert loaded.transfer_bytes == 4 * BLOCK_BYTES and loaded.transfer_time_s >= 0
    assert np.array_equal(host[[7, 6, 5, 4]], original[:4])
    with pytest.raises(ValueError, match="not pending"):
        tier.wait(3)
    counters = tier.counters()
    assert (counters["written_blocks"], counters["hits_blocks"], counters["corrupt"]) == (4, 4, 0)


def id_of(result: JobResult) -> int:
    return result.job_id


def test_a_corrupt_value_and_a_value_under_another_key_are_failed_keys(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier], host: np.ndarray
) -> None:
    tier = open_tier(redis_server.url)
    original = host.copy()
    keys = keys_of(4)
    store(tier, 1, keys, (0, 1, 2, 3))
    assert tier.wait(1).success
    plain = redis_server.client()
    plain.setrange(store_name(keys[0]), HEADER_BYTES + 5, bytes([int(host[0, 5]) ^ 0xFF]))
    moved = plain.get(store_name(keys[2]))
    assert isinstance(moved, bytes)
    plain.set(store_name(keys[1]), moved)  # an intact value, of another key

    host[4:] = 0
    result = load(tier, 2, keys, (4, 5, 6, 7))
    assert not result.success and result.successful_keys == keys[2:]
    assert result.error is not None
    assert "checksum x1" in result.error and "key x1" in result.error
    assert np.array_equal(host[6:], original[2:4])  # the good ones landed
    assert tier.counters()["corrupt"] == 2
    assert plain.exists(store_name(keys[0]), store_name(keys[1])) == 0  # deleted: misses now
    assert tier.lookup(keys) == 0 and tier.lookup(keys[2:]) == 2


def test_keys_of_another_type_are_deleted_and_counted_never_refusals(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier], host: np.ndarray,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # Regression: a list, hash, set or sorted set under a block key answered GET with
    # WRONGTYPE, a miss on every run (and a "refused" line), and was never deleted.
    tier = open_tier(redis_server.url)
    original = host.copy()
    keys = keys_of(5)
    store(tier, 1, keys[4:], (4,))
    assert tier.wait(1).success
    plain = redis_server.client()
    plain.rpush(store_name(keys[0]), b"a list")
    plain.hset(store_name(keys[1]), b"field", b"a hash")
    plain.sadd(store_name(keys[2]), b"a set")
    plain.zadd(store_name(keys[3]), {b"a sorted set": 1.0})

    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        host[:] = 0
        result = load(tier, 2, keys, (0, 1, 2, 3, 5))
    assert result.successful_keys == keys[4:] and np.array_equal(host[5], original[4])
    assert result.error == "0 blocks missing, failed checks: type x4"
    assert plain.exists(*(store_name(key) for key in keys[:4])) == 0  # deleted
    assert [record.getMessage() for record in caplog.records] == []  # no refusal, no outage
    counters = tier.counters()
    assert (counters["corrupt"], counters["outages"], counters["hits_blocks"]) == (4, 0, 1)
    # Later reads miss cleanly, and the blocks can be stored there again.
    assert tier.lookup(keys) == 0
    again = load(tier, 3, keys[:4], (0, 1, 2, 3))
    assert again.successful_keys == () and again.error == "4 blocks missing"
    assert tier.counters()["corrupt"] == 4
    store(tier, 4, keys[:4], (4, 5, 6, 7))
    assert tier.wait(4).success
    assert load(tier, 5, keys[:4], (0, 1, 2, 3)).success


def test_an_oversized_value_is_read_only_one_value_long_then_deleted(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier], host: np.ndarray
) -> None:
    # Regression: GET read a value of any size whole (200 MB under a block key ran into
    # the timeout: an outage on every read, and the value was never deleted).
    tier = open_tier(redis_server.url)
    keys = keys_of(3)
    store(tier, 1, keys[1:], (1, 2))
    assert tier.wait(1).success
    plain = redis_server.client()
    huge_bytes = 32 * 1024 * 1024
    plain.setrange(store_name(keys[0]), huge_bytes - 1, b"x")  # built on the server
    plain.append(store_name(keys[1]), b"+")  # a good value and one byte more

    sent_before = int(plain.info("stats")["total_net_output_bytes"])
    result = load(tier, 2, keys, (5, 6, 7))
    sent_bytes = int(plain.info("stats")["total_net_output_bytes"]) - sent_before
    assert result.successful_keys == keys[2:]
    assert result.error == "0 blocks missing, failed checks: length x1, magic x1"
    # What the server sent for the three values: about three blocks, never 32 MiB.
    assert sent_bytes < 4 * (HEADER_BYTES + BLOCK_BYTES) + 16 * 1024, sent_bytes
    assert plain.exists(store_name(keys[0]), store_name(keys[1])) == 0  # deleted
    counters = tier.counters()
    assert (counters["corrupt"], counters["outages"], counters["hits_blocks"]) == (2, 0, 1)
    again = load(tier, 3, keys, (5, 6, 7))
    assert again.successful_keys == keys[2:] and again.error == "2 blocks missing"
    assert tier.counters()["corrupt"] == 2


def test_a_killed_store_is_a_miss_never_an_exception(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier]
) -> None:
    tier = open_tier(redis_server.url)
    keys = keys_of(2)
    store(tier, 1, keys, (0, 1))
    assert tier.wait(1).success
    redis_server.kill()
    assert tier.lookup(keys) == 0
    assert not tier.available
    missed = load(tier, 2, keys, (2, 3))
    assert not missed.success and missed.successful_keys == ()
    store(tier, 3, keys_of(1, "later"), (4,))
    skipped = tier.wait(3)
    assert skipped.successful_keys == () and "is down" in (skipped.error or "")
    counters = tier.counters()
    assert (counters["outages"], counters["skipped_writes"], counters["misses_blocks"]) == (1, 1, 2)


def test_wrong_jobs_are_programming_errors(
    redis_server: RedisServer, open_tier: Callable[[str], RedisTier]
) -> None:
    tier = open_tier(redis_server.url)
    key = keys_of(1)
    with pytest.raises(ValueError, match="32 bytes"):
        TransferJob(1, (b"short",), (0,), is_load=True)
    with pytest.raises(ValueError, match="repeat"):
        TransferJob(1, keys_of(2), (0, 0), is_load=True)
    with pytest.raises(ValueError, match="leave"):
        tier.submit_load(TransferJob(1, key, (NUM_SLOTS,), is_load=True))
    with pytest.raises(ValueError, match="other"):
        tier.submit_load(TransferJob(1, key, (0,), is_load=False))
    store(tier, 1, key, (0,))
    with pytest.raises(ValueError, match="already in use"):
        tier.submit_load(TransferJob(1, key, (1,), is_load=True))
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.submit_load(TransferJob(2, key, (1,), is_load=True))
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]  # closing finished it
