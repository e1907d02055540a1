"""The shared tier on a real 3-master Redis Cluster (Debian's redis-server on loopback).

The same `RedisTier` and engine as on one server, given a `redis+cluster://`
URL of seed nodes: blocks written, looked up and read back across slots (their
keys spread over every master: no hash tag), two `kvswap run` processes sharing
a prefix through the cluster, and a master killed mid-run costing misses and
recomputation, never an error or a changed output.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator

import numpy as np
import pytest
from redis.cluster import RedisCluster

from kvswap.base.identity import chain_key
from kvswap.config_load import load_config
from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import key_name, layout_fingerprint
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
from kvswap.data.tiers.base import TransferJob
from kvswap.data.tiers.redis_tier import RedisTier
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import ConfigError
from tests.integration.remote_store_support import FakeClock, remote_lines, runs_sharing_a_prefix
from tests.integration.test_remote_engine import BASE, SYSTEM, run, workload
from tests.redis_cluster import RedisCluster3, redis_cluster, redis_cluster_missing
from tests.redis_server import HOST

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


def test_keys_of_another_type_and_oversized_values_are_deleted_on_a_cluster(
    redis_cluster: RedisCluster3, tier: RedisTier
) -> None:
    # Regression: such keys were misses (or outages) on every read, never deleted.
    keys = keys_of(12)
    good = keys[8:]
    assert move(tier, 1, good, load=False) == set(good)
    seed_port = redis_cluster.nodes[0].port
    assert seed_port is not None
    plain = RedisCluster(host=HOST, port=seed_port)
    try:
        for index, key in enumerate(keys[:8]):  # over every master: no hash tag
            name = f"{NAMESPACE}:{key.hex()}".encode()
            if index % 2:
                plain.rpush(name, b"a list")
            else:
                plain.setrange(name, 8 * 1024 * 1024 - 1, b"x")  # 8 MiB of zeros
        sent_before = sent_bytes(redis_cluster)
        assert move(tier, 2, keys, load=True) == set(good)
        assert sent_bytes(redis_cluster) - sent_before < 1024 * 1024  # never a whole value
        assert plain.exists(*(f"{NAMESPACE}:{key.hex()}" for key in keys[:8])) == 0
    finally:
        plain.close()
    stats = tier.stats()
    assert (stats.corrupt_blocks, stats.outages, stats.hits_blocks) == (8, 0, 4)
    assert tier.lookup(keys) == 0 and tier.lookup(good) == 4


def sent_bytes(cluster: RedisCluster3) -> int:
    """Bytes every node has sent its clients."""
    total = 0
    for node in cluster.nodes:
        with node.client() as client:
            total += int(client.info("stats")["total_net_output_bytes"])
    return total


def test_a_dead_master_flapping_is_counted_and_logged_once_a_minute(
    redis_cluster: RedisCluster3, tier: RedisTier, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression: with a master dead and no replica, a call reaching its slots is an
    # outage and a probe missing them a reconnect: two log lines every 0.5 to 6 s.
    keys = keys_of(NUM_BLOCKS)
    assert move(tier, 1, keys, load=False) == set(keys)
    with redis_cluster.nodes[1].client() as dead_node:
        on_dead = {name.decode() for name in dead_node.keys("*")}
    dead = next(key for key in keys if f"{NAMESPACE}:{key.hex()}" in on_dead)
    live = next(key for key in keys if f"{NAMESPACE}:{key.hex()}" not in on_dead)
    redis_cluster.nodes[1].kill()
    clock = FakeClock()
    start_s = clock.now_s
    client = RemoteStoreClient(
        parse_remote_url(redis_cluster.url, {}), namespace=NAMESPACE, timeout_ms=2000,
        clock=clock,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        for _flap in range(75):  # 150 s: down, back 0.5 s later, down 1.5 s after that
            assert client.lookup((dead,)) == 0  # an outage
            clock.advance(0.5)
            assert client.lookup((live,)) == 1  # the probe: reachable again
            clock.advance(1.5)
        assert client.lookup((dead,)) == 0  # down for good now (not logged: too soon)
        while clock.now_s < start_s + 185:  # failed probes; logged once 60 s have passed
            clock.advance(0.25)
            if client.available:
                assert client.lookup((dead,)) == 0
        clock.advance(30.0)
        assert client.lookup((live,)) == 1
    client.close()
    lines = remote_lines(caplog)
    assert [line.split(" is ")[1].split()[0] for line in lines] == [
        "unreachable", "reachable", "unreachable", "reachable", "unreachable", "reachable",
        "unreachable", "reachable",
    ]  # fmt: skip
    assert "not logged" not in lines[0]
    assert "(29 outages since the last such line were not logged" in lines[2]
    assert "(29 outages since the last such line were not logged" in lines[4]
    # 120 s + 60 s after the last line: the outage that began at 150 s is logged.
    assert "unreachable for 31.5 s" in lines[6] and "(14 outages" in lines[6]
    assert "reachable again after 65.0 s" in lines[7]
    assert (client.num_outages, client.num_reconnects) == (76, 76)  # every one counted


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
    settings = engine_settings(config, EngineOptions(model="tiny"))
    # The master holding the shared prompt's first block: the next run's lookups reach it.
    assert settings.control.remote is not None
    root = settings.control.layout.key_namespace().root_key()
    first = key_name(settings.control.remote.namespace, chain_key(root, SYSTEM[:8]))
    with Engine(settings) as engine:
        engine.run(workload(0))  # the cluster holds the shared prompt now
        cluster = RedisCluster(host=HOST, port=redis_cluster.nodes[0].port)
        port = cluster.get_node_from_key(first).port
        cluster.close()
        (holder,) = [node for node in redis_cluster.nodes if node.port == port]
        holder.kill()
        after = engine.run(workload(10)).to_json()
    assert after["outputs_digest"] == run(workload(10))["outputs_digest"]
    assert after["remote"]["outages"] >= 1
