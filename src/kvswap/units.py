"""Byte sizes: parsing "6GiB"-style strings and formatting counts for humans."""

from __future__ import annotations

import math
import re

from kvswap.errors import ConfigError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
PIB = 1024**5
#: The largest size any kvswap setting accepts. No GPU, host pool or NVMe tier comes near
#: 1 PiB, and the bound keeps every byte count a finite float (1e300 GiB would overflow).
MAX_SIZE_BYTES = PIB
MAX_SIZE_GIB = MAX_SIZE_BYTES // GIB

_SUFFIX_BYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size_bytes(value: int | float | str, field: str) -> int:
    """Parse `value` ("6GiB", "512 MB", 1048576) into a whole number of bytes.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (KB, MB, GB, TB) powers of 1000, as on a disk label.
    """
    allowed = "a non-negative byte count or a size such as '6GiB', '512MiB', '80GB'"
    if isinstance(value, bool):
        raise ConfigError(f"{field}: {value!r} is not a size; expected {allowed}")
    if isinstance(value, int | float):
        # NaN and infinity are floats that int() cannot take: reject them before it does.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{field}: {value!r} is not a size; expected {allowed}")
        if value < 0 or value != int(value):
            raise ConfigError(f"{field}: {value!r} is not a size; expected {allowed}")
        if value > MAX_SIZE_BYTES:
            raise _too_large(value, field)
        return int(value)
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _SUFFIX_BYTES:
        raise ConfigError(f"{field}: {value!r} is not a size; expected {allowed}")
    number = float(match.group(1))
    scale = _SUFFIX_BYTES[match.group(2).lower()]
    num_bytes = number * scale
    # A few hundred digits parse as float('inf'): bound before int() sees it.
    if num_bytes > MAX_SIZE_BYTES:
        raise _too_large(value, field)
    if num_bytes != int(num_bytes):
        raise ConfigError(f"{field}: {value!r} is not a whole number of bytes")
    return int(num_bytes)


def _too_large(value: int | float | str, field: str) -> ConfigError:
    return ConfigError(
        f"{field}: {value!r:.60} is too large; allowed: 0..{MAX_SIZE_BYTES} bytes (1 PiB)"
    )


def gib_to_bytes(value: float, flag: str) -> int:
    """A size given in GiB (a float flag such as --gpu-mem-gib) as whole bytes.

    KvSwapError naming `flag` for NaN, infinity, a negative size or one past 1 PiB,
    so that no later int() or float arithmetic meets a value it cannot hold.
    """
    if not math.isfinite(value) or not 0 <= value <= MAX_SIZE_GIB:
        raise ConfigError(
            f"{flag} = {value}: allowed: a finite number of GiB in 0..{MAX_SIZE_GIB} (1 PiB)"
        )
    return int(value * GIB)


def format_bytes(num_bytes: float) -> str:
    """Format a byte count with a binary suffix: 2097152 -> '2.00 MiB'."""
    value = float(num_bytes)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or suffix == "TiB":
            return f"{int(value)} B" if suffix == "B" else f"{value:.2f} {suffix}"
        value /= 1024
    raise AssertionError("unreachable")


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator (blocks for tokens, slots for bytes)."""
    return -(-numerator // denominator)
