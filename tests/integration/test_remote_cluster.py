"""The shared tier on a real 3-master Redis Cluster (Debian's redis-server on loopback).

The same `RedisTier` and engine as on one server, given a `redis+cluster://`
URL of seed nodes: blocks written, looked up and read back across slots (their
keys spread over every master: no hash tag), two `kvswap run` processes sharing
a prefix through the cluster, and a master killed mid-run costing misses and
recomputation, never an error or a changed output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest

from kvswap.config import load_config
from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import layout_fingerprint
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
from kvswap.data.tiers.base import TransferJob
from kvswap.data.tiers.redis_tier import RedisTier
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import ConfigError
from tests.integration.remote_store_support import runs_sharing_a_prefix
from tests.integration.test_remote_engine import BASE, run, workload
from tests.redis_cluster import RedisCluster3, redis_cluster, redis_cluster_missing

__all__ = ["redis_cluster"]
pytestmark = pytest.mark.skipif(
    redis_cluster_missing() is not None, reason="no redis-server / redis-cli"
)

BLOCK_BYTES = 4096
NUM_BLOCKS = 96
NAMESPACE = "cluster-ns"


def keys_of(count: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"block-{i}".encode()).digest() for i in range(count))


@pytest.fixture
def host() -> np.ndarray:
    rng = np.random.default_rng(3)
    return rng.integers(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)


@pytest.fixture
def tier(redis_cluster: RedisCluster3, host: np.ndarray) -> Iterator[RedisTier]:
    client = RemoteStoreClient(
        parse_remote_url(redis_cluster.url, {}), namespace=NAMESPACE, timeout_ms=2000
    )
    client.connect(required=True)
    fingerprint = layout_fingerprint(KVLayout.from_block_bytes(BLOCK_BYTES))
    opened = RedisTier(client, host, layout_fingerprint=fingerprint)
    yield opened
    opened.close()


def move(tier: RedisTier, job_id: int, keys: tuple[bytes, ...], *, load: bool) -> set[bytes]:
    """One job over the first len(keys) host slots; the keys that succeeded."""
    job = TransferJob(job_id, keys, tuple(range(len(keys))), is_load=load)
    (tier.submit_load if load else tier.submit_store)(job)
    return set(tier.wait(job_id).successful_keys)


def test_blocks_round_trip_across_slots_and_spread_over_every_master(
    redis_cluster: RedisCluster3, tier: RedisTier, host: np.ndarray
) -> None:
    keys = keys_of(NUM_BLOCKS)
    expected = host.copy()
    assert move(tier, 1, keys, load=False) == set(keys)
    assert tier.lookup(keys) == NUM_BLOCKS
    assert tier.lookup((*keys[:10], hashlib.sha256(b"absent").digest(), *keys[10:])) == 10
    host[:] = 0
    assert move(tier, 2, keys, load=True) == set(keys)
    assert np.array_equal(host, expected)
    # No hash tag: each key's slot is its own, so every master holds about a third.
    counts = redis_cluster.key_counts()
    assert sum(counts) == NUM_BLOCKS
    assert min(counts) >= NUM_BLOCKS // 6, counts


def test_a_master_killed_mid_run_is_misses_not_errors(
    redis_cluster: RedisCluster3, tier: RedisTier
) -> None:
    keys = keys_of(NUM_BLOCKS)
    assert move(tier, 1, keys, load=False) == set(keys)
    redis_cluster.nodes[1].kill()
    assert tier.lookup(keys) < NUM_BLOCKS  # the dead master's blocks are not there
    loaded = move(tier, 2, keys, load=True)
    assert len(loaded) < NUM_BLOCKS  # misses (the caller recomputes), no exception
    stored = move(tier, 3, keys_of(NUM_BLOCKS + 8)[NUM_BLOCKS:], load=False)
    assert len(stored) < 8
    assert tier.stats().outages >= 1


def test_a_hash_tag_namespace_is_refused_for_a_cluster() -> None:
    url = parse_remote_url("redis+cluster://127.0.0.1:1,127.0.0.1:2", {})
    with pytest.raises(ConfigError, match="hash tag would put every block on one"):
        RemoteStoreClient(url, namespace="{model}", timeout_ms=100)


def test_two_kvswap_run_processes_share_a_prefix_through_the_cluster(
    redis_cluster: RedisCluster3,
) -> None:
    alone, first, second = runs_sharing_a_prefix(redis_cluster.url)
    assert first["outputs_digest"] == second["outputs_digest"] == alone["outputs_digest"]
    assert first["remote"]["writes"] > 0
    assert second["prefix_hit_tokens"]["remote"] >= 32  # the system prompt's four blocks


def test_a_master_killed_mid_run_changes_no_output(redis_cluster: RedisCluster3) -> None:
    config = load_config(environ={}, overrides={**BASE, "remote_url": redis_cluster.url})
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        engine.run(workload(0))  # the cluster holds the shared prompt now
        redis_cluster.nodes[0].kill()
        after = engine.run(workload(10)).to_json()
    assert after["outputs_digest"] == run(workload(10))["outputs_digest"]
    assert after["remote"]["outages"] >= 1
