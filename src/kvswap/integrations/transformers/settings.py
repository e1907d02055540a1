"""What a `TieredCache` is built with: one frozen record, checked once.

Sizes are in blocks of `block_tokens` tokens of ONE layer of ONE sequence (a
batch row): K and V, `[2, block_tokens, num_kv_heads, head_dim]`. Every bad value
is one `ConfigError` line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvswap.base.eviction_policy import PolicyOptions
from kvswap.control.policy import check_policy_names
from kvswap.errors import ConfigError

if TYPE_CHECKING:
    from kvswap.data.remote_copy import TierFactory

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
    cpu_blocks            the pinned CPU slot pool; with a tier below, at least what
                          `check_cpu_blocks` names
    nvme_blocks, nvme_dir the NVMe slab below it, by key (0: none; nvme_dir needs
                          nvme_blocks)
    remote_url            the shared store below it (`tiers.remote_url` forms), or None
    secondary_tiers       tiers of one's own below the store, fastest first: factories
                          called as factory(host_slots, layout) -> SecondaryTier
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
    secondary_tiers: tuple[TierFactory, ...] = ()
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
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, Path):
            raise ConfigError(f"nvme_dir = {self.nvme_dir!r}; allowed: a directory path")
        if self.nvme_blocks and self.nvme_dir is None:
            raise ConfigError(
                f"nvme_blocks = {self.nvme_blocks} needs nvme_dir; allowed: a directory for "
                "the slab, or nvme_blocks = 0"
            )
        if self.nvme_dir is not None and not self.nvme_blocks:
            # Else the directory would be ignored without a word (no slab is made).
            raise ConfigError(
                f"nvme_dir = {str(self.nvme_dir)!r} needs nvme_blocks; allowed: nvme_blocks "
                ">= 1 (the slab's blocks), or no nvme_dir"
            )
        if self.remote_url is not None and (
            not isinstance(self.remote_url, str) or not self.remote_url
        ):
            raise ConfigError(
                f"remote_url = {self.remote_url!r:.80}; allowed: a store URL string "
                "(redis://, rediss://, unix://) or None"
            )
        tiers = self.secondary_tiers
        if not isinstance(tiers, tuple) or not all(callable(factory) for factory in tiers):
            raise ConfigError(
                f"secondary_tiers = {tiers!r:.80}; allowed: a sequence of factories, each "
                "called as factory(host_slots, layout) and returning a SecondaryTier"
            )
        timeout = self.remote_timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ConfigError(f"remote_timeout_ms = {timeout!r:.80}; allowed: a number > 0")
        if not 0 < timeout < math.inf:
            raise ConfigError(f"remote_timeout_ms = {timeout!r}; allowed: a number > 0")
        for name in ("gpu_eviction_policy", "cpu_eviction_policy", "nvme_eviction_policy"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"{name} = {getattr(self, name)!r:.80}; allowed: 'kvswap', 'lru', 'arc', "
                    "'reuse' or 'package.module:Class'"
                )
        check_policy_names(self.policy_options())

    def check_cpu_blocks(self, num_layers: int, batch_size: int) -> None:
        """A pinned pool big enough for the tiers below it to add capacity, or one line
        naming the smallest. Every block that leaves for NVMe or the store, or comes up
        from them, passes through the pinned pool, so one going down and one coming up
        need a slot each. The tiers below take full blocks only (each by its key): the
        last (partial) block of each row of every other layer waits in the pinned pool
        too (the layer whose turn it is holds its own on the device)."""
        if not self.has_keyed_tiers:
            return
        waiting = (num_layers - 1) * batch_size
        if self.cpu_blocks >= waiting + 2:
            return
        below = "an NVMe slab" if self.nvme_blocks else "a tier below it"
        raise ConfigError(
            f"cpu_blocks = {self.cpu_blocks} with {below}: the tiers below the pinned pool take "
            f"full blocks only, so the last block of {batch_size} row(s) of {num_layers - 1} "
            "other layers waits in the pinned pool, next to a block going down and one "
            f"coming up; allowed: cpu_blocks >= {waiting + 2}"
        )

    @property
    def has_keyed_tiers(self) -> bool:
        """An NVMe slab, a store (`remote_url`) or a tier of one's own below the pinned
        pool: each a tier addressed by key."""
        return bool(self.nvme_blocks) or self.remote_url is not None or bool(self.secondary_tiers)

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
