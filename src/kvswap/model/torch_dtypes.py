"""kvswap's dtype names (`kvswap.model.dtypes`) -> torch dtypes; the only torch-side table.

Keyed by exactly the names of DTYPE_BYTES, and checked against it at import,
so a name's byte count in the ledger is its tensors' itemsize.
"""

from __future__ import annotations

import torch

from kvswap.errors import KvSwapError
from kvswap.model.dtypes import DTYPE_BYTES, WEIGHT_DTYPES, normalise_dtype

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,  # KV storage only; the decoder computes in WEIGHT_DTYPES
}
if {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()} != DTYPE_BYTES:
    raise AssertionError("TORCH_DTYPES and DTYPE_BYTES must name the same dtypes and sizes")


def torch_dtype(name: str) -> torch.dtype:
    """Any dtype spelling `normalise_dtype` accepts -> its torch dtype."""
    return TORCH_DTYPES[normalise_dtype(name)]


def weight_torch_dtype(name: str) -> torch.dtype:
    """A dtype the decoder can hold weights in ('fp32', 'fp16', 'bf16', or the checkpoint
    spelling 'float32', ...) -> its torch dtype; a one-line error for any other."""
    try:
        short = normalise_dtype(name)
    except KvSwapError:
        short = name
    if short not in WEIGHT_DTYPES:
        raise KvSwapError(f"unknown dtype {name!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    return TORCH_DTYPES[short]
