"""The options every connection to the store opens with (`remote_store` for one
server, `remote_cluster` for a cluster), in one place."""

from __future__ import annotations

from typing import Any

from redis.backoff import NoBackoff
from redis.retry import Retry

from kvswap.data.remote_url import RemoteUrl


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
