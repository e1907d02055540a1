"""The remote tier on a private 3-master Redis Cluster: bytes/s and the key spread.

Starts three redis-servers in cluster mode on free loopback ports
(tests/redis_cluster.py), stops them at the end, and measures against them:

  bandwidth  the bandwidth section's passes (remote_bandwidth.py) with a
             `redis+cluster://` URL: RemoteCopyEngine vs plain redis-py's
             `RedisCluster`, one SET / GET per block (goal: >= 0.8 each way)
  spread     `num_spread_blocks` block keys written through the tier: the share
             of them each master holds (no hash tag: about a third each)
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine_support import Goal, Result, require
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
from remote_bandwidth import section_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.redis_cluster import RedisCluster3, redis_cluster_missing

NUM_SPREAD_BLOCKS = 3000


def _spread(cluster: RedisCluster3, num_blocks: int) -> list[float]:
    """Each master's share of `num_blocks` tiny values written under block keys."""
    client = RemoteStoreClient(
        parse_remote_url(cluster.url), namespace="kvswap-spread", timeout_ms=10_000.0
    )
    client.connect(required=True)
    try:
        for start in range(0, num_blocks, 500):
            items = [
                (hashlib.sha256(f"spread:{i}".encode()).digest(), b"x")
                for i in range(start, min(start + 500, num_blocks))
            ]
            outcome = client.put_many(items)
            require(not outcome.failed_indices, f"spread writes failed: {outcome.error}")
    finally:
        client.close()
    counts = cluster.key_counts()
    return [count / sum(counts) for count in counts]


def section_cluster(_url: str, **options: Any) -> Result:
    """Bandwidth and key spread on a private cluster (`_url`, the single store, unused)."""
    missing = redis_cluster_missing()
    require(missing is None, f"no cluster to start: {missing}")
    with (
        tempfile.TemporaryDirectory(prefix="kvswap-bench-cluster-") as work_dir,
        RedisCluster3(Path(work_dir)).start() as cluster,
    ):
        result = section_bandwidth(cluster.url, **options)
        shares = _spread(cluster, NUM_SPREAD_BLOCKS)
    figures = dict(result.figures)
    figures["key_share_min"] = round(min(shares), 4)
    figures["key_share_max"] = round(max(shares), 4)
    goals = dict(result.goals)
    goals["key_share_min"] = Goal(">=", 0.25)  # about a third each: no master left out
    shapes = {**result.shapes, "masters": len(shares), "spread_blocks": NUM_SPREAD_BLOCKS}
    return Result(shapes, figures, goals)
