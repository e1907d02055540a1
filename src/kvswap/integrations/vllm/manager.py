"""The scheduler side: vLLM's own managers, with kvswap's ranking and a step clock.

vLLM's `CPUOffloadingManager` keeps the host tier's chunk pool, reference counts
and events; it asks a `CachePolicy` which chunks to evict. Here that policy is
`KvswapCachePolicy`, and the managers add the two things vLLM does not pass a
policy:

- a step clock. No step counter reaches a `CachePolicy`, and
  `TieringOffloadingManager` does not forward `on_schedule_end` (the last manager
  call of a scheduler step) to its primary tier, so these managers tick the
  policy's clock there: kvswap's minimum residency counts scheduler steps.
- where a chunk came from. A promotion (a secondary tier -> the host tier) is a
  block brought back from a slower tier; `KvswapPrimaryTier` says so when it
  completes (`complete_write`), and the secondary tiers say which chunks they
  stored (`copied_below`: a clean chunk, cheaper to drop).

    KvswapHostManager      CPUOffloadingManager + clock          (no secondary tier)
    KvswapPrimaryTier      CPUPrimaryTierOffloadingManager + the promotions' origin
    KvswapTieringManager   TieringOffloadingManager + the primary tier's clock
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
from kvswap.integrations.vllm.cache_policy import KvswapCachePolicy
from kvswap.integrations.vllm.host_file import SCHEDULER


class StepClock:
    """Counts scheduler steps and moves the host tier's policy along with them."""

    def __init__(self, policy: KvswapCachePolicy) -> None:
        self.policy = policy
        self.step = 0

    def tick(self) -> None:
        self.step += 1
        self.policy.advance(self.step)


class KvswapHostManager(CPUOffloadingManager):
    """vLLM's host-tier manager ranked by kvswap, with a step clock."""

    def __init__(
        self, num_chunks: int, policy: KvswapCachePolicy, *, enable_events: bool, **extras: Any
    ) -> None:
        super().__init__(num_chunks=num_chunks, enable_events=enable_events, **extras)
        # vLLM's factory passes a policy nothing but its capacity, so the manager
        # builds its default and the ranking replaces it before any chunk exists.
        self._policy = policy
        self.clock = StepClock(policy)

    def on_schedule_end(self, context: Any) -> None:
        super().on_schedule_end(context)
        self.clock.tick()


class SharedHostRows:
    """The host pool as the scheduler's secondary tiers see it: [num_chunks, row_bytes]
    rows of the buffer the worker fills (one file, `host_file.py`), with what vLLM's
    primary tier asks of a region."""

    def __init__(self, path: Path, num_chunks: int, row_bytes: int) -> None:
        self._buffer = PinnedBuffer(
            num_chunks * row_bytes, what="vLLM host tier", shared=SharedFile(path, SCHEDULER)
        )
        self._rows = self._buffer.tensor.numpy().reshape(num_chunks, row_bytes)

    @property
    def rows(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self._rows

    def create_kv_memoryview(self) -> memoryview:
        view: memoryview = self._rows.data  # 2-D: vLLM reads a row's bytes from strides[0]
        return view

    def cleanup(self) -> None:
        self._buffer.close()


class KvswapPrimaryTier(CPUPrimaryTierOffloadingManager):
    """vLLM's primary (host) tier under secondary tiers, ranked by kvswap."""

    def __init__(
        self,
        num_chunks: int,
        rows: SharedHostRows,
        policy: KvswapCachePolicy,
        *,
        enable_events: bool,
        **extras: Any,
    ) -> None:
        super().__init__(
            num_chunks=num_chunks, mmap_region=rows, enable_events=enable_events, **extras
        )
        self._policy = policy  # as in KvswapHostManager
        self.clock = StepClock(policy)
        # vLLM completes a promotion through this alias of complete_store.
        self.complete_write = self._complete_promotion

    def _complete_promotion(
        self, keys: Collection[bytes], req_context: Any, success: bool = True
    ) -> None:
        if success:
            self._policy.arriving(keys)
        self.complete_store(keys, req_context, success)


class KvswapTieringManager(TieringOffloadingManager):
    """vLLM's tiering manager; ticks its primary tier's clock every step."""

    primary_tier: KvswapPrimaryTier

    def on_schedule_end(self, context: Any) -> None:
        super().on_schedule_end(context)
        self.primary_tier.clock.tick()
