"""The occupancy lines a run is steered by, as fractions of a tier's capacity.

GPU: swap-out starts above `gpu_high` and stops at `gpu_low`. CPU (the pinned
pool): demotion to NVMe starts above `cpu_high` and stops at `cpu_low`. The
live panel, the plots and the exporter draw these next to measured occupancy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from kvswap.config import KvSwapConfig
from kvswap.control.settings import SwapSettings


@dataclass(frozen=True)
class Watermarks:
    gpu_high: float = 0.85
    gpu_low: float = 0.65
    cpu_high: float = 0.90
    cpu_low: float = 0.80

    @classmethod
    def from_config(cls, config: KvSwapConfig) -> Watermarks:
        swap = config.swap
        return cls(
            gpu_high=swap.swap_out_high_watermark,
            gpu_low=swap.swap_out_low_watermark,
            cpu_high=swap.cpu_demote_high_watermark,
            cpu_low=swap.cpu_demote_low_watermark,
        )

    @classmethod
    def from_swap_settings(cls, swap: SwapSettings) -> Watermarks:
        """The watermarks the swapper was built with (an engine's settings record)."""
        return cls(
            gpu_high=swap.swap_out_high_watermark,
            gpu_low=swap.swap_out_low_watermark,
            cpu_high=swap.cpu_demote_high_watermark,
            cpu_low=swap.cpu_demote_low_watermark,
        )

    def for_tier(self, tier: str) -> tuple[float, float] | None:
        """(high, low) for `tier` ('gpu', 'cpu'); None for a tier without watermarks."""
        if tier == "gpu":
            return self.gpu_high, self.gpu_low
        if tier == "cpu":
            return self.cpu_high, self.cpu_low
        return None

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Watermarks:
        values = {
            name: float(value)
            for name, value in data.items()
            if name in cls.__dataclass_fields__ and isinstance(value, int | float)
        }
        return cls(**values)
