"""What names a shared store, checked where it is configured and where it is used:
the URL schemes kvswap connects by, and the rule for a key namespace."""

from __future__ import annotations

#: A cluster's scheme -> the scheme of its nodes (Valkey speaks the same protocol).
CLUSTER_SCHEMES = {
    "redis+cluster": "redis",
    "rediss+cluster": "rediss",
    "valkey+cluster": "redis",
    "valkeys+cluster": "rediss",
}
#: Every scheme `kvswap.data.remote_url` accepts (the config's first check names them).
REMOTE_URL_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
MAX_NAMESPACE_CHARS = 200


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis (or Valkey) Cluster by its scheme."""
    return url.partition("://")[0] in CLUSTER_SCHEMES


def namespace_problem(namespace: object, *, cluster: bool = False) -> str | None:
    """Why `namespace` is no usable key prefix (printable, no spaces, 1..200 characters;
    on a `cluster`, no braces), or None: the one rule, for the store and for the
    configuration that names it. A block's key must route by itself: a '{...}' hash
    tag in the prefix would put every block of a model on one cluster shard."""
    if (
        not isinstance(namespace, str)
        or not 1 <= len(namespace) <= MAX_NAMESPACE_CHARS
        or any(char.isspace() or not char.isprintable() for char in namespace)
    ):
        return f"allowed: 1 to {MAX_NAMESPACE_CHARS} printable characters without spaces"
    if cluster and ("{" in namespace or "}" in namespace):
        return (
            "a '{...}' hash tag would put every block on one cluster shard; allowed: a "
            "namespace without braces"
        )
    return None
