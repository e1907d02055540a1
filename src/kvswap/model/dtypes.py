"""THE dtype table: kvswap's dtype names and their size in bytes.

Every other spelling ("bfloat16", "torch.float16", "float8_e4m3fn") is an alias
of one of these names. The torch side maps the same names to torch dtypes
(`kvswap.model.torch_dtypes`), so the byte count the ledger bills and the one
a tensor occupies come from one place. Torch-free on purpose.
"""

from __future__ import annotations

from kvswap.errors import KvSwapError

#: kvswap's dtype names -> bytes per value. The config's `dtype` field takes these names.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

#: The dtypes a checkpoint's weights (and the decoder) are held in; fp8 is a KV-only dtype.
WEIGHT_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16")

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}  # fmt: skip
_ALLOWED_DTYPES = "fp32, fp16, bf16, fp8 (or float32, float16, bfloat16, float8_e4m3fn)"


def normalise_dtype(name: str) -> str:
    """Map a dtype name ("bf16", "bfloat16", "torch.float16") to a DTYPE_BYTES key."""
    key = name.strip().lower().removeprefix("torch.")
    if key in DTYPE_BYTES:
        return key
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    raise KvSwapError(f"unknown dtype {name!r}; allowed: {_ALLOWED_DTYPES}")


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of `dtype` (any spelling `normalise_dtype` accepts)."""
    return DTYPE_BYTES[normalise_dtype(dtype)]


def weight_dtype_or_none(name: object) -> str | None:
    """`name` as a weights dtype, or None when it names none ("auto", fp8, not a string)."""
    if not isinstance(name, str):
        return None
    try:
        dtype = normalise_dtype(name)
    except KvSwapError:
        return None
    return dtype if dtype in WEIGHT_DTYPES else None
