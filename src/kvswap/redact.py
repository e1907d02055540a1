"""Secrets never shown: a URL's password becomes `***` in every message and output.

    redis://:hunter2@10.0.0.5:6379/0   ->  redis://:***@10.0.0.5:6379/0
    redis://kv:hunter2@host/0          ->  redis://kv:***@host/0

Torch-free and dependency-free, so the config, the data plane and the
observers share it.
"""

from __future__ import annotations

import re

# scheme://[user][:password]@rest  (up to the last '@' before the path)
_CREDENTIALS = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@/]*:)(?P<password>[^/]*)@")
# ?password=... in a query string (redis-py accepts it for unix:// URLs)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&#]*)")

MASK = "***"


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***; everything else unchanged."""
    redacted = _CREDENTIALS.sub(lambda m: f"{m['head']}{MASK}@", url, count=1)
    return _QUERY_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", redacted)
