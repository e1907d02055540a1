"""A user's object by import path, 'package.module:Name', for a setting that takes one.

The doors of kvswap that take a user's code (an eviction policy class, a secondary
tier's factory) name it by path. Whatever goes wrong (a path without a colon, a
module that fails to import, a name it lacks) is one `ConfigError` line naming the
setting, the value, the cause and what is allowed; the user's traceback is not shown.
"""

from __future__ import annotations

import importlib

from kvswap.errors import ConfigError


def split_import_path(value: str) -> tuple[str, str] | None:
    """('package.module', 'Name') for 'package.module:Name'; None if it is not one."""
    module_name, colon, name = value.partition(":")
    if not colon or not module_name.strip() or not name.strip() or ":" in name:
        return None
    return module_name, name


def import_object(field: str, value: str, allowed: str, *, shown: str = "") -> object | None:
    """What `value` ('package.module:Name') names, or None when the module has no
    such name (the caller says what it needed); `allowed` ends each error line, which
    names the setting's whole value `shown` (default: `value`)."""
    shown = shown or value
    parts = split_import_path(value)
    if parts is None:
        raise ConfigError(f"{field} = {shown!r}: not an import path; allowed: {allowed}")
    module_name, name = parts
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of a user's module is one config error
        raise ConfigError(
            f"{field} = {shown!r}: cannot import {module_name!r} ({one_line(error)}); "
            f"allowed: {allowed}"
        ) from None
    return getattr(module, name, None)


def one_line(error: BaseException) -> str:
    """`error` as 'Type: its first line', for a message about a user's code."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
