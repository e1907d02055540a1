"""A throwaway 3-master Redis Cluster of Debian's redis-server on loopback.

Three `RedisServer`s (tests/redis_server.py) with cluster mode on, each in its
own directory on a free port, joined by `redis-cli --cluster create` (no
replicas), ready when every node reports `cluster_state:ok`:

    with RedisCluster3(tmp_path).start() as cluster:
        cluster.url            # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
        cluster.nodes[1].kill()   # a master dies

`cluster-require-full-coverage no`: when a master dies, the others keep serving
their own slots (as a deployment that prefers a partial cache to none would).
Without redis-server or redis-cli the fixtures skip, saying why.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import HOST, RedisServer, redis_server_missing

REDIS_CLI = shutil.which("redis-cli")
NUM_MASTERS = 3
_READY_TIMEOUT_S = 30.0


def redis_cluster_missing() -> str | None:
    reason = redis_server_missing()
    if reason is None and REDIS_CLI is None:
        reason = "redis-cli not found: install Debian's redis-tools package"
    return reason


CLUSTER_ARGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
    "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
)  # fmt: skip


class RedisCluster3:
    def __init__(self, work_dir: Path) -> None:
        self.nodes = [
            RedisServer(work_dir / f"node-{i}", extra_args=CLUSTER_ARGS) for i in range(NUM_MASTERS)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{HOST}:{node.port}" for node in self.nodes)

    def start(self) -> RedisCluster3:
        reason = redis_cluster_missing()
        if reason is not None:
            pytest.skip(reason)
        try:
            for node in self.nodes:
                node.start()
            assert REDIS_CLI is not None
            addresses = [f"{HOST}:{node.port}" for node in self.nodes]
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                 "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            states = []
            for node in self.nodes:
                with node.client() as client:
                    states.append(client.execute_command("CLUSTER", "INFO"))
            if all(b"cluster_state:ok" in state for state in states):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def key_counts(self) -> list[int]:
        """Keys held by each master (DBSIZE), for the spread of a namespace's blocks."""
        counts = []
        for node in self.nodes:
            with node.client() as client:
                counts.append(int(client.dbsize()))
        return counts

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    with RedisCluster3(tmp_path / "cluster").start() as cluster:
        yield cluster
