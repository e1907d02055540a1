"""Secrets never shown: a URL's password becomes `***` in every message and output.

    redis://:hunter2@10.0.0.5:6379/0   ->  redis://:***@10.0.0.5:6379/0
    redis://kv:hunter2@host/0          ->  redis://kv:***@host/0

Torch-free and dependency-free, so the config, the data plane and the
observers share it.
"""

from __future__ import annotations

import re

# ?password=... in a query string (redis-py accepts it for unix:// URLs)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&#]*)")

MASK = "***"


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***, even in a URL too broken to parse
    (a raw '/' or '@' inside the password): everything between the user name and
    the last '@' is masked, and so is a query string's password."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        credentials, _, tail = rest.rpartition("@")
        user, colon, _password = credentials.partition(":")
        if colon:
            url = f"{scheme}://{user}:{MASK}@{tail}"
    return _QUERY_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", url)
