"""How kvswap opens redis-py clients for the remote store: the options every
connection opens with, one server's client (`server_client`), and a Redis (or
Valkey) Cluster's (`LazyCluster`).

`RemoteStoreClient` talks to a cluster exactly as to one server (pipelined
EXISTS / TYPE + GETRANGE / SET NX, UNLINK, PING, INFO); redis-py splits each pipeline by node
and sends every node its part before reading any answer. What differs for a cluster:

  - Built at the first call that needs it, not at start: redis-py's constructor
    asks a seed node for the slot table and raises when none answers, and an
    unreachable store must be a miss and a later reconnect probe, as for one
    server. A build that fails is an outage like any other (`CLUSTER_OUTAGE_ERRORS`).
  - A block's key routes by itself: "<namespace>:<key hex>" has no "{...}" hash
    tag, so its slot is the CRC16 of the whole name and a model's blocks spread
    over every master (README: the measured spread). A namespace with a tag would
    pile every block of a model on one shard: `base.remote_names.namespace_problem`
    refuses it, for the configuration and for the store.
  - A master that dies fails the calls that reach its slots (a connection error):
    the client's state machine counts an outage and answers misses, and its
    reconnect probes find the cluster again (with `cluster-require-full-coverage
    no` on the servers, the live masters keep their slots meanwhile). Calls never
    retry inside redis-py: the timeout and the backoff are the client's.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvswap.data.remote_url import RemoteUrl

#: Failures of a cluster as a whole (no seed node answered, a slot nobody serves).
CLUSTER_OUTAGE_ERRORS = (RedisClusterException,)

# Arguments above this size are sent as their own buffers (redis-py's own cutoff).
_BUFFER_CUTOFF_BYTES = 6000


def connection_options(url: RemoteUrl, timeout_s: float, socket_read_bytes: int) -> dict[str, Any]:
    """What every connection to the store is opened with, one server's or a cluster's:
    the URL's credentials, `timeout_s` on every call, no driver retries (an outage is
    ours to handle), RESP2 (every Redis and Valkey speaks it)."""
    return {
        "username": url.username,
        "password": url.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "socket_read_size": socket_read_bytes,
        "retry": Retry(NoBackoff(), 0),
        "protocol": 2,
    }


def server_client(url: RemoteUrl, timeout_s: float, socket_read_bytes: int) -> redis.Redis:
    """One client over one pool. No driver retries (an outage is ours to handle), RESP2
    (every Redis and Valkey speaks it), bytes in and out, and a command packer that
    sends large values from their own buffers (see `_zero_copy_packer`)."""
    options = connection_options(url, timeout_s, socket_read_bytes)
    options.update(db=url.db, health_check_interval=0)
    packer = _zero_copy_packer()
    if packer is not None:
        options["command_packer"] = packer
    connection_class: type[
        redis.connection.Connection | redis.connection.UnixDomainSocketConnection
    ]
    if url.scheme == "unix":
        connection_class = redis.connection.UnixDomainSocketConnection
        options["path"] = url.socket_path
    else:
        options.update(host=url.host, port=url.port)
        connection_class = redis.connection.Connection
        if url.uses_tls:
            connection_class = redis.connection.SSLConnection
            options["ssl_ca_certs"] = url.ssl_ca_certs
    pool = redis.ConnectionPool(connection_class=connection_class, **options)
    return redis.Redis(connection_pool=pool)


def _zero_copy_packer() -> object | None:
    """redis-py's pure-Python command packer, which passes a memoryview argument to
    `sendall` as it is. With hiredis installed redis-py packs every command with
    hiredis, which copies each value twice (to bytes, then into the packed command):
    two fresh 1 MiB allocations per block written. None (use the default) where this
    redis-py has no such packer."""
    serializer = getattr(redis.connection, "PythonRespSerializer", None)
    if serializer is None:
        return None
    packer: object = serializer(_BUFFER_CUTOFF_BYTES, _encode_argument)
    return packer


def _encode_argument(value: object) -> bytes | bytearray | memoryview:
    """A command argument as the protocol sends it (the packer's `encode`)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot send a {type(value).__name__} to the store")


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
