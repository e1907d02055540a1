"""Reading raw settings: a TOML file and `KVSWAP_*` environment variables.

Values come back unvalidated; `kvswap.config_load.load_config` merges and checks them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvswap.errors import ConfigError
from kvswap.readers import CONFIG_FILE, parse_toml, read_user_file

#: KVSWAP_* variables that carry secrets, not settings: read where they are used,
#: never merged into the config (whose values may be printed).
API_KEY_VARIABLE = "KVSWAP_API_KEY"
REMOTE_PASSWORD_VARIABLE = "KVSWAP_REMOTE_PASSWORD"
SECRET_VARIABLES = frozenset({API_KEY_VARIABLE, REMOTE_PASSWORD_VARIABLE})


def read_toml(path: Path) -> dict[str, Any]:
    """The file's table, or a one-line ConfigError naming the file and the problem."""
    what = f"config file {str(path)!r}"
    try:
        # A FIFO, a device or a directory is refused before reading; the size is capped.
        data = read_user_file(path, what, CONFIG_FILE, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist") from None
    except OSError as error:
        raise ConfigError(f"{what} cannot be read: {error.strerror or error}") from None
    # parse_toml turns binary, deep nesting, bad syntax and nan/inf into one line each.
    return parse_toml(data, what)


def source_values(
    environ: Mapping[str, str], prefix: str, field_sections: Mapping[str, str]
) -> dict[str, Any]:
    """Settings from `PREFIX<FIELD>` variables, e.g. KVSWAP_SWAP_OUT_CHUNK_BLOCKS=16.

    An unknown `PREFIX*` variable is an error, not silently ignored: a typo in
    a variable name would otherwise leave the default in force unnoticed.
    """
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name in SECRET_VARIABLES:
            continue
        field = name[len(prefix) :].lower()
        if field not in field_sections:
            valid = [prefix + known.upper() for known in field_sections]
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"environment variable {name} is not a kvswap setting{hint}")
        values[field] = None if raw.strip().lower() in ("", "none") else raw
    return values
