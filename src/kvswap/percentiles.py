"""Nearest-rank percentiles: the one rule every summary, report and benchmark uses.

    nearest_rank([3.0, 1.0, 2.0], 0.5)   -> 2.0
    ranked([1.0, 2.0, 3.0], 0.5)         -> 2.0 (already sorted)
    percentiles_ms([0.010, 0.020])       -> {"p50": 10.0, "p95": 20.0, "p99": 20.0}

Torch-free and dependency-free, so any layer may read it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile `fraction` (0-1] of `values`; 0.0 when there is none."""
    return ranked(sorted(values), fraction)


def ranked(ordered: Sequence[float], fraction: float) -> float:
    """`nearest_rank` of values already in ascending order (several percentiles of one
    sample sort it once)."""
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def percentiles_ms(values_s: Sequence[float]) -> dict[str, float]:
    """{p50, p95, p99} in milliseconds (nearest rank) of values in seconds; zeros when
    there is no sample."""
    ordered = sorted(values_s)
    return {
        f"p{round(fraction * 100)}": round(ranked(ordered, fraction) * 1e3, 3)
        for fraction in (0.50, 0.95, 0.99)
    }
