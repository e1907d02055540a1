"""The remote tier's address: `tiers.remote_url`, parsed and checked once.

Accepted forms (the Redis protocol: Redis 7, Valkey):

    redis://[user][:password]@host[:port][/db]     TCP; port 6379 and db 0 by default
    rediss://[user][:password]@host[:port][/db]    TLS; ?ssl_ca_certs=/path/ca.pem for a
                                                   private CA (else the system's)
    unix://[[user][:password]@]/path/to.sock[?db=N][&password=...]   a local socket
    redis+cluster://[user][:password]@host[:port][,host[:port]...][/0]
                                                   a Redis Cluster: seed nodes, the rest
                                                   found from them (db 0, the only one
                                                   a cluster has); rediss+cluster:// for
                                                   TLS; valkey+cluster://, valkeys+cluster://
                                                   the same for a Valkey cluster

User and password are percent-decoded (`p%40ss` is `p@ss`; a raw '/' or '@'
in a password must be written %2F / %40). The password comes from the URL or,
only when the URL has none, from the environment variable
`KVSWAP_REMOTE_PASSWORD`: a deployment can keep it out of config files and
process listings, and a password written in the URL is an explicit choice
that wins.

The password never leaves this module as text: `RemoteUrl.shown` is the URL
with it masked (what every message, log line and report shows), the
dataclass repr omits it, and `RemoteUrl.scrub()` masks it in foreign text (a
driver's exception message) before that text is shown. A malformed URL is one
`ConfigError` line naming what is wrong and what is allowed; the URL in it is
masked too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

from kvswap.base.remote_names import CLUSTER_SCHEMES
from kvswap.config_sources import REMOTE_PASSWORD_VARIABLE
from kvswap.errors import ConfigError
from kvswap.redact import MASK, redact_url

#: Where the password is read from when the URL carries none.
PASSWORD_ENV = REMOTE_PASSWORD_VARIABLE
DEFAULT_PORT = 6379
#: Redis numbers databases 0..databases-1 (16 by default; a server may have more).
MAX_DB = 2**31 - 1

Scheme = Literal["redis", "rediss", "unix"]
_ALLOWED = (
    "redis://[user][:password]@host[:port][/db], rediss://... (TLS), unix:///path/to.sock[?db=N], "
    "redis+cluster://host:port[,host:port...] (or rediss+, valkey+, valkeys+cluster://)"
)
# Query parameters each scheme understands.
_QUERY_KEYS: dict[str, frozenset[str]] = {
    "redis": frozenset(),
    "rediss": frozenset({"ssl_ca_certs"}),
    "unix": frozenset({"db", "password"}),
}
_QUERY_KEYS.update({name: _QUERY_KEYS[node] for name, node in CLUSTER_SCHEMES.items()})


@dataclass(frozen=True)
class RemoteUrl:
    """A checked store address. `password` is never part of the repr or `shown`."""

    scheme: Scheme
    shown: str
    """The URL as written, password masked: what every message shows."""
    host: str | None = None
    port: int | None = None
    socket_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_from_env: bool = False
    ssl_ca_certs: str | None = None
    # A Redis Cluster's seed nodes (host, port), the first also as host / port; empty
    # for a single server.
    cluster_nodes: tuple[tuple[str, int], ...] = ()

    @property
    def uses_tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def is_cluster(self) -> bool:
        return bool(self.cluster_nodes)

    def scrub(self, text: str) -> str:
        """`text` with this URL's password (raw or percent-encoded) masked."""
        if not self.password:
            return text
        for spelling in sorted({self.password, quote(self.password, safe="")}, key=len)[::-1]:
            text = text.replace(spelling, MASK)
        return text


class _UrlProblem(Exception):
    """What is wrong with the URL; turned into one ConfigError line by the caller."""


def parse_remote_url(url: str, environ: Mapping[str, str] | None = None) -> RemoteUrl:
    """Check `url` and read its parts; `environ` (default `os.environ`) supplies
    `KVSWAP_REMOTE_PASSWORD` when the URL has no password."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"remote_url {url!r} is empty; allowed: {_ALLOWED}")
    shown = redact_url(url)
    try:
        return _parse(url, shown, os.environ if environ is None else environ)
    except _UrlProblem as problem:
        raise ConfigError(f"remote_url {shown!r}: {problem}; allowed: {_ALLOWED}") from None


def _parse(url: str, shown: str, environ: Mapping[str, str]) -> RemoteUrl:
    if any(char.isspace() or not char.isprintable() for char in url):
        raise _UrlProblem("it contains a space or a control character")
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced '[' of an IPv6 address
        raise _UrlProblem("the host part is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in _QUERY_KEYS:
        raise _UrlProblem(f"unknown scheme {parts.scheme + '://' if parts.scheme else '(none)'}")
    if not url.partition(":")[2].startswith("//"):
        raise _UrlProblem(f"the scheme must be followed by '//' ({scheme}://...)")
    if "@" in parts.path or "@" in parts.query:
        # urlsplit cut the authority at a raw '/', '?' or '#' inside the password.
        raise _UrlProblem("'@' after the host: percent-encode '/', '?', '#', '@' in a password")
    if parts.fragment:
        raise _UrlProblem("a '#fragment' means nothing here")
    query = _query(parts.query, scheme)
    if scheme in CLUSTER_SCHEMES:
        return _cluster(parts, shown, CLUSTER_SCHEMES[scheme], query, environ)
    password = unquote(parts.password) if parts.password else query.get("password") or None
    from_env = False
    if password is None and environ.get(PASSWORD_ENV):
        password, from_env = environ[PASSWORD_ENV], True
    username = unquote(parts.username) if parts.username else None
    if scheme == "unix":
        if parts.netloc.rpartition("@")[2]:
            raise _UrlProblem("a unix socket URL names no host; write unix:///path/to.sock")
        if not parts.path.startswith("/") or parts.path == "/":
            raise _UrlProblem("a unix socket URL needs an absolute socket path")
        return RemoteUrl(
            scheme="unix", shown=shown, socket_path=parts.path,
            db=_db(query["db"], "?db=") if "db" in query else 0,
            username=username, password=password, password_from_env=from_env,
        )  # fmt: skip
    host, port = _host_and_port(parts)
    db_text = parts.path.removeprefix("/")
    return RemoteUrl(
        scheme="redis" if scheme == "redis" else "rediss", shown=shown, host=host, port=port,
        db=_db(db_text, "the path") if db_text else 0,
        username=username, password=password, password_from_env=from_env,
        ssl_ca_certs=query.get("ssl_ca_certs"),
    )  # fmt: skip


def _cluster(
    parts: SplitResult,
    shown: str,
    node_scheme: str,
    query: dict[str, str],
    environ: Mapping[str, str],
) -> RemoteUrl:
    """A cluster URL: credentials once, then comma-separated seed nodes."""
    credentials, at, hosts = parts.netloc.rpartition("@")
    user, colon, raw_password = credentials.partition(":")
    password = unquote(raw_password) if colon and raw_password else None
    from_env = False
    if password is None and environ.get(PASSWORD_ENV):
        password, from_env = environ[PASSWORD_ENV], True
    nodes = []
    for seed in hosts.split(","):
        try:
            node = urlsplit(f"//{seed}")
        except ValueError:
            raise _UrlProblem("a seed node's host part is malformed") from None
        nodes.append(_host_and_port(node))
    if len(set(nodes)) != len(nodes):
        raise _UrlProblem("a seed node is given twice")
    db_text = parts.path.removeprefix("/")
    if db_text not in ("", "0"):
        raise _UrlProblem(f"db {db_text!r}: a cluster has only db 0")
    host, port = nodes[0]
    return RemoteUrl(
        scheme="rediss" if node_scheme == "rediss" else "redis", shown=shown, host=host,
        port=port, username=unquote(user) if at and user else None, password=password,
        password_from_env=from_env, ssl_ca_certs=query.get("ssl_ca_certs"),
        cluster_nodes=tuple(nodes),
    )  # fmt: skip


def _query(text: str, scheme: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError:
        raise _UrlProblem("the query string is malformed") from None
    allowed = _QUERY_KEYS[scheme]
    values: dict[str, str] = {}
    for key, value in pairs:
        if key not in allowed:
            names = ", ".join(sorted(allowed)) or "none"
            raise _UrlProblem(f"unknown query parameter {key!r} for {scheme}:// (known: {names})")
        if key in values:
            raise _UrlProblem(f"query parameter {key!r} is given twice")
        values[key] = value
    return values


def _host_and_port(parts: SplitResult) -> tuple[str, int]:
    if not parts.hostname:
        raise _UrlProblem("no host; write e.g. redis://127.0.0.1:6379/0")
    try:
        port = parts.port
    except ValueError:
        raise _UrlProblem("the port is not a number from 1 to 65535") from None
    if port is None:
        if parts.netloc.endswith(":"):
            raise _UrlProblem("the port after ':' is empty")
        return parts.hostname, DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise _UrlProblem(f"port {port} is not a number from 1 to 65535")
    return parts.hostname, port


def _db(text: str, where: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_DB:
        raise _UrlProblem(f"db {text!r} in {where} is not a database number 0..{MAX_DB}")
    return int(text)
