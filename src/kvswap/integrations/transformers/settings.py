"""What a `TieredCache` is built with: one frozen record, checked once.

Sizes are in blocks of `block_tokens` tokens of ONE layer of ONE sequence (a
batch row): K and V, `[2, block_tokens, num_kv_heads, head_dim]`. Every bad value
is one `ConfigError` line naming the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvswap.control.eviction_policy import PolicyOptions
from kvswap.control.policy import check_policy_names
from kvswap.errors import ConfigError

#: Copy lanes for the HIGH queue (swap-in, prefetch): kvswap's `prefetch_stream_count`.
MAX_PREFETCH_STREAMS = 8


@dataclass(frozen=True)
class TieredCacheSettings:
    """A tiered cache's sizes and switches.

    resident_blocks       device blocks, all layers and rows together: what stays on
                          the GPU. At least one layer's blocks (all rows) plus every
                          sequence's sink blocks must fit, or a step cannot run.
    block_tokens          tokens per block
    protected_sink_blocks the first blocks of each layer's sequence never leave the device
    min_residency_steps   a block brought back stays that many decode steps (0: a
                          layer-wise cache reads every block each step, so a window
                          longer than 0 keeps nearly everything resident)
    cpu_blocks            the pinned CPU slot pool
    nvme_blocks, nvme_dir the NVMe slab below it (0: none)
    remote_url            the shared store below it (`tiers.remote_url` forms), or None
    gpu_eviction_policy, cpu_eviction_policy, nvme_eviction_policy: kvswap's policy
                          names ("kvswap", "lru", "package.module:Class")
    prefetch_streams      HIGH-queue lanes moving blocks up at once
    remote_timeout_ms     every store call's bound
    """

    resident_blocks: int
    cpu_blocks: int
    block_tokens: int = 16
    protected_sink_blocks: int = 1
    min_residency_steps: int = 0
    nvme_blocks: int = 0
    nvme_dir: Path | None = None
    remote_url: str | None = None
    remote_timeout_ms: float = 500.0
    gpu_eviction_policy: str = "kvswap"
    cpu_eviction_policy: str = "kvswap"
    nvme_eviction_policy: str = "kvswap"
    prefetch_streams: int = 1

    def __post_init__(self) -> None:
        for name, low in (
            ("resident_blocks", 1),
            ("cpu_blocks", 1),
            ("block_tokens", 1),
            ("protected_sink_blocks", 0),
            ("min_residency_steps", 0),
            ("nvme_blocks", 0),
        ):
            _check_int(name, getattr(self, name), low, None)
        _check_int("prefetch_streams", self.prefetch_streams, 1, MAX_PREFETCH_STREAMS)
        if self.nvme_blocks and self.nvme_dir is None:
            raise ConfigError(
                f"nvme_blocks = {self.nvme_blocks} needs nvme_dir; allowed: a directory for "
                "the slab, or nvme_blocks = 0"
            )
        if not self.remote_timeout_ms > 0:
            raise ConfigError(
                f"remote_timeout_ms = {self.remote_timeout_ms!r}; allowed: a number > 0"
            )
        check_policy_names(self.policy_options())

    def policy_options(self) -> PolicyOptions:
        """kvswap's policy switches for this cache: sinks protected when there are any."""
        return PolicyOptions(
            sink_protection=self.protected_sink_blocks > 0,
            min_residency_steps=self.min_residency_steps,
            gpu_eviction_policy=self.gpu_eviction_policy,
            cpu_eviction_policy=self.cpu_eviction_policy,
            nvme_eviction_policy=self.nvme_eviction_policy,
        )


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f"an integer >= {low}" if high is None else f"an integer {low}..{high}"
        raise ConfigError(f"{name} = {value!r}; allowed: {allowed}")
