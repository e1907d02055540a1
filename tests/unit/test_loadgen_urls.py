"""`kvswap loadgen`'s server address and key (issue 30, item 7): every malformed --url,
and a key no HTTP header can carry, is one line and exit 2 before anything is built or
sent; before, urlsplit's and httpx's own exceptions were tracebacks and exit 1."""

from __future__ import annotations

import pytest

from kvswap.errors import KvSwapError
from kvswap.serve.loadgen.client import api_base

from .cli_checks import cli, one_error_line

ALLOWED = "allowed: an http:// or https:// URL of the server"

MALFORMED_URLS: list[tuple[str, str]] = [
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://[zz]:80", "'zz' does not appear to be an IPv4 or IPv6 address"),
    ("http://[v1.x]:80", "Invalid IPv6 address"),
    ("http://[::1]x:80", "Invalid port"),
    ("http://256.1.1.1:80", "Invalid IPv4 address"),
    ("http://h:99999", "the port is not a number in 1..65535"),
    ("http://[::1]:99999", "the port is not a number in 1..65535"),
    ("http://h:abc", "the port is not a number in 1..65535"),
    ("http://h:-1", "the port is not a number in 1..65535"),
    ("http://h:0", "the port is not a number in 1..65535"),
    ("http://h:8000\\v1", "the port is not a number in 1..65535"),
    ("http://:8000", "no host"),
    ("http://u:secret@", "no host"),
    ("http://h\x00st:1", "it holds a space or an unprintable character"),
    ("http://h:1/\x7f", "it holds a space or an unprintable character"),
    ("http://h st:1", "it holds a space or an unprintable character"),
    (" http://h:1", "it holds a space or an unprintable character"),
    ("http://h:1/v1#top", "a query or a fragment"),
    ("ftp://h:1", "not http or https"),
    ("http://h\udcff:1", "it holds a space or an unprintable character"),  # $'\xff' in argv
]


@pytest.mark.parametrize(("url", "why"), MALFORMED_URLS)
def test_a_malformed_url_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], url: str, why: str
) -> None:
    code, out, err = cli(capsys, "loadgen", "--url", url, "--synthetic", "--quiet")
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert f": {why}" in line and line.endswith(f"{ALLOWED}, e.g. http://127.0.0.1:8000")
    assert "secret" not in line  # a password never reaches a message


def test_well_formed_urls_still_pass() -> None:
    assert api_base("http://[::1]:8000") == "http://[::1]:8000/v1"
    assert api_base("https://u:p@h/x/v1/") == "https://u:p@h/x/v1"
    assert api_base("HTTP://h") == "http://h/v1"  # urlsplit lowers the scheme
    with pytest.raises(KvSwapError, match="no host"):
        api_base("http://")


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("s\u00e9same", "--api-key: character 'é' at 1 cannot be sent in an HTTP header"),
        ("a\nb", "--api-key: character '\\n' at 1 cannot be sent in an HTTP header"),
        ("\udcff", "--api-key: not valid UTF-8 (byte 0xff at byte 0); allowed: UTF-8 text"),
    ],
)
def test_a_key_no_header_can_carry_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, key: str, needle: str
) -> None:
    url = "http://127.0.0.1:9"  # never reached: the key is refused first
    code, _, err = cli(capsys, "loadgen", "--url", url, "--api-key", key, "--synthetic")
    assert code == 2 and needle in one_error_line(err)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    code, _, err = cli(capsys, "loadgen", "--url", url, "--synthetic")
    assert code == 2 and needle.replace("--api-key", "OPENAI_API_KEY") in one_error_line(err)
