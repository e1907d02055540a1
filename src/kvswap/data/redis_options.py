"""How kvswap opens redis-py clients: the options every connection to the store opens
with (`remote_store` for one server, `remote_cluster` for a cluster), in one place,
and one server's client."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvswap.data.remote_url import RemoteUrl

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
