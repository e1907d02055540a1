"""A host-tier ranking's figure over the better of LRU's and ARC's: the ratio every
policy benchmark and the rendered page give (inside vLLM, vLLM's own two rankings; in
the simulator, kvswap's implementations of them). No imports but the standard
library's, so the renderer can use it without a vLLM venv."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: vLLM's own rankings (its CPUOffloadingManager's), the baseline of every ratio.
VLLM_POLICIES = ("lru", "arc")


def ratios(rows: Sequence[dict[str, Any]], figure: str = "hit_tokens") -> dict[str, float]:
    """Each of kvswap's rankings' `figure` over the better of vLLM's LRU and ARC's: all
    prefix-hit tokens (the device's and the host tier's), or `host_hit_tokens`, the
    host tier's own. Empty when neither of vLLM's rankings has any."""
    best = max((r[figure] for r in rows if r["policy"] in VLLM_POLICIES), default=0)
    if not best:
        return {}
    return {
        r["policy"]: round(r[figure] / best, 4) for r in rows if r["policy"] not in VLLM_POLICIES
    }
