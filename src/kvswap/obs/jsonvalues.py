"""Typed reads from parsed JSON (summaries, report.json) without `Any`.

A report file written by an older or newer kvswap may lack a key; readers get
None (or the default) and decide, instead of a KeyError deep in a plot.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvswap.errors import KvSwapError


def as_mapping(value: object, what: str = "value") -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise KvSwapError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def lookup(data: Mapping[str, object], *keys: str) -> object:
    """data[k1][k2]...; None when a key is missing or an inner value is not an object."""
    value: object = data
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def number(data: Mapping[str, object], *keys: str) -> float | None:
    value = lookup(data, *keys)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def number_or(data: Mapping[str, object], *keys: str, default: float = 0.0) -> float:
    value = number(data, *keys)
    return default if value is None else value


def integer_or(data: Mapping[str, object], *keys: str, default: int = 0) -> int:
    value = lookup(data, *keys)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def int_map(data: Mapping[str, object], *keys: str) -> dict[str, int]:
    value = lookup(data, *keys)
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


def float_map(data: Mapping[str, object], *keys: str) -> dict[str, float]:
    value = lookup(data, *keys)
    if not isinstance(value, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
