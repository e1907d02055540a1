"""`tiers.remote_url`: the accepted forms, the one-line refusals, the password kept out."""

from __future__ import annotations

import pytest

from kvswap.data.remote_url import PASSWORD_ENV, parse_remote_url
from kvswap.errors import ConfigError
from kvswap.redact import redact_url

NO_ENV: dict[str, str] = {}


def test_tcp_url_parts_and_defaults() -> None:
    url = parse_remote_url("redis://10.0.0.5", NO_ENV)
    assert (url.scheme, url.host, url.port, url.db, url.password) == (
        "redis", "10.0.0.5", 6379, 0, None,
    )  # fmt: skip
    url = parse_remote_url("rediss://kv:p%40ss@cache.example:6380/3", NO_ENV)
    assert (url.scheme, url.host, url.port, url.db) == ("rediss", "cache.example", 6380, 3)
    assert (url.username, url.password, url.uses_tls) == ("kv", "p@ss", True)
    assert parse_remote_url("redis://[::1]:7000/1", NO_ENV).host == "::1"


def test_unix_socket_url() -> None:
    url = parse_remote_url("unix:///run/redis/redis.sock?db=2", NO_ENV)
    assert (url.scheme, url.socket_path, url.db, url.host) == (
        "unix", "/run/redis/redis.sock", 2, None,
    )  # fmt: skip
    assert parse_remote_url("unix://:pw@/tmp/r.sock", NO_ENV).password == "pw"
    assert parse_remote_url("unix:///tmp/r.sock?password=pw", NO_ENV).password == "pw"


def test_rediss_takes_a_ca_bundle() -> None:
    url = parse_remote_url("rediss://h/0?ssl_ca_certs=/etc/ca.pem", NO_ENV)
    assert url.ssl_ca_certs == "/etc/ca.pem"


def test_a_cluster_url_names_its_seed_nodes() -> None:
    url = parse_remote_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]", NO_ENV)
    assert url.is_cluster and (url.scheme, url.host, url.port, url.db) == (
        "redis", "10.0.0.1", 7000, 0,
    )  # fmt: skip
    assert url.cluster_nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 6379))
    tls = parse_remote_url("valkeys+cluster://kv:p%40ss@h:1,g:2/0?ssl_ca_certs=/ca.pem", NO_ENV)
    assert (tls.uses_tls, tls.username, tls.password, tls.ssl_ca_certs) == (
        True, "kv", "p@ss", "/ca.pem",
    )  # fmt: skip
    assert "p%40ss" not in tls.shown and "***" in tls.shown
    assert parse_remote_url("valkey+cluster://h:1", {PASSWORD_ENV: "e"}).password == "e"
    assert not parse_remote_url("redis://h:1/0", NO_ENV).is_cluster


def test_the_environment_supplies_the_password_only_when_the_url_has_none() -> None:
    env = {PASSWORD_ENV: "from-env"}
    from_env = parse_remote_url("redis://h:1/0", env)
    assert (from_env.password, from_env.password_from_env) == ("from-env", True)
    from_url = parse_remote_url("redis://:in-url@h:1/0", env)
    assert (from_url.password, from_url.password_from_env) == ("in-url", False)
    assert parse_remote_url("redis://h:1/0", {PASSWORD_ENV: ""}).password is None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h:80/", "unknown scheme http://"),
        ("h:6379", "unknown scheme"),
        ("redis:/h", "followed by '//'"),
        ("redis://", "no host"),
        ("redis://h:abc/0", "port is not a number"),
        ("redis://h:0/0", "port 0 is not"),
        ("redis://h:70000/0", "port is not a number"),
        ("redis://h:/0", "port after ':' is empty"),
        ("redis://h/x", "db 'x'"),
        ("redis://h/-1", "db '-1'"),
        ("redis://h/0/1", "db '0/1'"),
        ("redis://h/99999999999", "db '99999999999'"),
        ("redis://h/0?timeout=1", "unknown query parameter 'timeout'"),
        ("unix://host/tmp/r.sock", "names no host"),
        ("unix://", "absolute socket path"),
        ("unix:///tmp/r.sock?db=z", "db 'z'"),
        ("unix:///tmp/r.sock?db=1&db=2", "given twice"),
        ("redis://h/0#frag", "fragment"),
        ("redis://h /0", "space"),
        ("redis://[::1/0", "host part is malformed"),
        ("redis+cluster://h:1,h:1", "seed node is given twice"),
        ("redis+cluster://h:1,", "no host"),
        ("redis+cluster://h:1,g:x", "port is not a number"),
        ("redis+cluster://h:1/2", "a cluster has only db 0"),
        ("redis+cluster://h:1?db=1", "unknown query parameter 'db'"),
        ("", "empty"),
    ],
)
def test_malformed_urls_are_one_line(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_remote_url(url, NO_ENV)
    message = str(caught.value)
    assert problem in message
    assert "\n" not in message
    assert message.startswith("remote_url ")


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@h:abc/0",  # bad port, password in the URL
        "redis://kv:hunter2@h/x",  # bad db
        "redis://:hunter2/x@h/0",  # a raw '/' in the password
        "redis://:hunter2?@h/0",  # a raw '?' in the password
        "redis://:hunter2@h/0?timeout=1",
        "unix:///tmp/r.sock?password=hunter2&db=x",
    ],
)
def test_the_password_never_appears_in_a_refusal(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_remote_url(url, NO_ENV)
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def test_repr_and_shown_hide_the_password() -> None:
    url = parse_remote_url("redis://kv:hunter2@h:1/0", NO_ENV)
    assert url.shown == "redis://kv:***@h:1/0"
    assert "hunter2" not in repr(url)
    env_url = parse_remote_url("redis://h:1/0", {PASSWORD_ENV: "hunter2"})
    assert "hunter2" not in repr(env_url) and "hunter2" not in env_url.shown
    assert redact_url("redis://:a/b@c@h/0") == "redis://:***@h/0"


def test_scrub_masks_the_password_in_foreign_text() -> None:
    url = parse_remote_url("redis://:p%40ss@h:1/0", NO_ENV)
    assert url.scrub("AUTH p@ss failed; p%40ss") == "AUTH *** failed; ***"
    assert parse_remote_url("redis://h:1/0", NO_ENV).scrub("text") == "text"
