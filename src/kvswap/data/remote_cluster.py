"""A Redis (or Valkey) Cluster as the remote store: redis-py's `RedisCluster`, built lazily.

`RemoteStoreClient` talks to a cluster exactly as to one server (pipelined
EXISTS / TYPE + GETRANGE / SET NX, UNLINK, PING, INFO); redis-py splits each pipeline by node
and sends every node its part before reading any answer. What differs lives here:

  - Built at the first call that needs it, not at start: redis-py's constructor
    asks a seed node for the slot table and raises when none answers, and an
    unreachable store must be a miss and a later reconnect probe, as for one
    server. A build that fails is an outage like any other (`OUTAGE_ERRORS`).
  - A block's key routes by itself: "<namespace>:<key hex>" has no "{...}" hash
    tag, so its slot is the CRC16 of the whole name and a model's blocks spread
    over every master (README: the measured spread). A namespace with a tag would
    pile every block of a model on one shard: `check_cluster_namespace` refuses it.
  - A master that dies fails the calls that reach its slots (a connection error):
    the client's state machine counts an outage and answers misses, and its
    reconnect probes find the cluster again (with `cluster-require-full-coverage
    no` on the servers, the live masters keep their slots meanwhile). Calls never
    retry inside redis-py: the timeout and the backoff are the client's.
"""

from __future__ import annotations

import threading

from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from kvswap.data.redis_options import connection_options
from kvswap.data.remote_url import RemoteUrl
from kvswap.errors import ConfigError

#: Failures of a cluster as a whole (no seed node answered, a slot nobody serves).
OUTAGE_ERRORS = (RedisClusterException,)


def check_cluster_namespace(namespace: str) -> None:
    if "{" in namespace or "}" in namespace:
        raise ConfigError(
            f"remote_namespace {namespace!r:.80}: a '{{...}}' hash tag would put every "
            "block on one cluster shard; allowed: a namespace without braces"
        )


class LazyCluster:
    """One `RedisCluster` for `url`'s seed nodes, built by the first `get()`."""

    def __init__(self, url: RemoteUrl, timeout_s: float, socket_read_bytes: int) -> None:
        self._options = connection_options(url, timeout_s, socket_read_bytes)
        self._options.update(
            startup_nodes=[
                ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in url.cluster_nodes
            ],
            require_full_coverage=False,
        )
        if url.uses_tls:
            self._options.update(ssl=True, ssl_ca_certs=url.ssl_ca_certs)
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._closed = False

    def get(self) -> RedisCluster:
        """The cluster client; raises an outage error while no seed node answers."""
        with self._lock:
            if self._closed:
                raise RedisClusterException("the cluster client is closed")
            if self._client is None:
                self._client = RedisCluster(**self._options)
            return self._client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
