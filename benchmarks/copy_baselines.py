"""The contiguous copies `transfer.py` measures the swap path against.

The baseline is the fastest contiguous copy of the same bytes between the same
two pools that this machine does: torch's `copy_` of the whole pool (on
torch's intra-op threads, ordinary stores), and, with the device pool in host
memory, one numpy memcpy of it on one thread. glibc streams a copy that big
past the caches with non-temporal stores (above `x86_non_temporal_threshold`,
114 MiB on the project's machine), which no block-sized copy gets: on one
CPU-only machine the numpy copy was the faster one, on another torch's (README,
transfer section), hence both. `swap_*_vs_memcpy` is the ratio to torch's `copy_` (what transfer.py
always printed); `swap_*_vs_fastest_copy` the ratio to the faster of the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def timed_torch_copy(dst: torch.Tensor, src: torch.Tensor, sync: Callable[[], None]) -> float:
    """Seconds for one torch copy of the whole pool src -> dst (both [num_blocks,
    block_bytes]); `sync` waits for the device (a no-op on the CPU)."""
    sync()
    start_s = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync()
    return time.perf_counter() - start_s


def timed_numpy_copy(dst: np.ndarray, src: np.ndarray) -> float:
    """Seconds for one numpy copy of the whole pool src -> dst (host memory, both
    [num_blocks, block_bytes] and contiguous): a single memcpy on this thread."""
    start_s = time.perf_counter()
    np.copyto(dst.reshape(-1), src.reshape(-1))
    return time.perf_counter() - start_s


def baseline_report(rates_gb_per_s: dict[str, float]) -> dict[str, Any]:
    """The baseline keys from median rates named `memcpy_{out,in}` (torch) and,
    where measured, `numpy_{out,in}`: each rate, and the fastest copy each way."""
    report: dict[str, Any] = {
        "memcpy_gb_per_s": rates_gb_per_s["memcpy_out"],
        "memcpy_out_gb_per_s": rates_gb_per_s["memcpy_out"],
        "memcpy_in_gb_per_s": rates_gb_per_s["memcpy_in"],
        "numpy_memcpy_out_gb_per_s": rates_gb_per_s.get("numpy_out"),
        "numpy_memcpy_in_gb_per_s": rates_gb_per_s.get("numpy_in"),
    }
    for way in ("out", "in"):
        candidates = {"torch_copy": rates_gb_per_s[f"memcpy_{way}"]}
        if f"numpy_{way}" in rates_gb_per_s:
            candidates["numpy_memcpy"] = rates_gb_per_s[f"numpy_{way}"]
        fastest = max(candidates, key=lambda name: candidates[name])
        report[f"fastest_copy_{way}"] = fastest
        report[f"fastest_copy_{way}_gb_per_s"] = candidates[fastest]
    return report
