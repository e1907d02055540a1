"""Plain settings the control plane is built with (validated at the edge).

The control plane never reads the pydantic configuration: `kvswap.drive`
turns a validated `KvSwapConfig` into these frozen records once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapSettings:
    """Watermarks are fractions of a tier's blocks; chunks are counted in blocks."""

    block_bytes: int
    swap_out_high_watermark: float = 0.85  # GPU occupancy where swap-out starts
    swap_out_low_watermark: float = 0.65  # where it stops (also the admission ceiling)
    swap_out_chunk_blocks: int = 8
    swap_in_chunk_blocks: int = 4
    cpu_demote_high_watermark: float = 0.90
    cpu_demote_low_watermark: float = 0.80
