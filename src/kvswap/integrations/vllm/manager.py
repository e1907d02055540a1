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

Both host-tier managers count what the host tier does (`host_report.HostReport`:
the stats line and kvswap's counters on vLLM's /metrics) and keep a request that
offers more chunks than the whole tier from storing nothing: its first chunks are
offered (a prefix is found from its head), with one warning. Where the host tier is
the last one, it stores only the new chunks its ranking admits (`EvictionPolicy.admit`);
above secondary tiers it stores everything, which they are fed from.
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
from kvswap.integrations.vllm.host_report import HostReport
from kvswap.integrations.vllm.tiers import KvswapSecondaryTier


class StepClock:
    """Counts scheduler steps and moves the host tier's policy along with them; each
    tick may write the stats line."""

    def __init__(self, policy: KvswapCachePolicy, report: HostReport) -> None:
        self.policy = policy
        self.report = report
        self.step = 0

    def tick(self) -> None:
        self.step += 1
        self.policy.advance(self.step)
        self.report.counts.policy_failures = self.policy.num_failures
        self.report.tick()


class _ReportingHostTier(CPUOffloadingManager):
    """The counting and the whole-tier rule both host-tier managers share (module
    docstring). Set up by `_report_to` after vLLM's own constructor."""

    _policy: KvswapCachePolicy
    _num_chunks: int
    report: HostReport
    clock: StepClock
    #: Whether the ranking's `admit` may refuse new chunks: only where the host tier is
    #: the last (with tiers below, what it stores also feeds them).
    admits = True

    def _report_to(self, policy: KvswapCachePolicy, report: HostReport) -> None:
        # vLLM's factory passes a policy nothing but its capacity, so vLLM's constructor
        # builds its default and the ranking replaces it before any chunk exists.
        self._policy = policy
        self.report = report
        self.clock = StepClock(policy, report)

    def lookup(self, key: Any, req_context: Any) -> Any:
        result = super().lookup(key, req_context)
        self.report.counts.lookups += 1
        self.report.counts.hits += result.name == "HIT"
        return result

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        spec = super().prepare_load(keys, req_context)
        self.report.counts.loads += len(keys)
        return spec

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        offered = list(keys)
        if len(offered) > self._num_chunks:
            self.report.warn_small(len(offered))
            self.report.counts.refused += len(offered) - self._num_chunks
            offered = offered[: self._num_chunks]
        offered = self._admitted(offered)
        output = super().prepare_store(offered, req_context)
        counts = self.report.counts
        if output is None:
            counts.refused += sum(self._policy.get(key) is None for key in offered)
        else:
            counts.stores += len(output.keys_to_store)
            counts.evictions += len(output.evicted_keys)
        return output

    def _admitted(self, offered: list[Any]) -> list[Any]:
        """The offer less the new chunks the ranking would not take (`admit`): a chunk
        already held stays in (vLLM counts it a reuse); of the new ones, the first."""
        if not self.admits:
            return offered
        new = [key for key in offered if self._policy.get(key) is None]
        taken = self._policy.admit(len(new), self._get_num_free_chunks())
        if taken >= len(new):
            return offered
        refused = set(new[taken:])
        self.report.counts.refused += len(refused)
        return [key for key in offered if key not in refused]

    def get_stats(self) -> Any:
        """vLLM's own stats of the tier, with kvswap's counts added (`HostReport.take`)."""
        stats = super().get_stats()
        if stats is not None:
            self.report.counts.policy_failures = self._policy.num_failures
            self.report.take(stats.increase_counter)
        return stats


class KvswapHostManager(_ReportingHostTier):
    """vLLM's host-tier manager ranked by kvswap, with a step clock."""

    def __init__(
        self,
        num_chunks: int,
        policy: KvswapCachePolicy,
        report: HostReport,
        *,
        enable_events: bool,
        **extras: Any,
    ) -> None:
        super().__init__(num_chunks=num_chunks, enable_events=enable_events, **extras)
        self._report_to(policy, report)

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


class KvswapPrimaryTier(_ReportingHostTier, CPUPrimaryTierOffloadingManager):
    """vLLM's primary (host) tier under secondary tiers, ranked by kvswap. It stores all
    it is offered: each chunk it takes is cascaded to the tiers below."""

    admits = False

    def __init__(
        self,
        num_chunks: int,
        rows: SharedHostRows,
        policy: KvswapCachePolicy,
        report: HostReport,
        *,
        enable_events: bool,
        **extras: Any,
    ) -> None:
        super().__init__(
            num_chunks=num_chunks, mmap_region=rows, enable_events=enable_events, **extras
        )
        self._report_to(policy, report)
        # vLLM completes a promotion through this alias of complete_store.
        self.complete_write = self._complete_promotion

    def _complete_promotion(
        self, keys: Collection[bytes], req_context: Any, success: bool = True
    ) -> None:
        if success:
            self._policy.arriving(keys)
        self.complete_store(keys, req_context, success)


class KvswapTieringManager(TieringOffloadingManager):
    """vLLM's tiering manager; ticks its primary tier's clock every step, and can
    promote a request's chunks at once (`promote_now`, for `KvswapConnector`)."""

    primary_tier: KvswapPrimaryTier

    def on_schedule_end(self, context: Any) -> None:
        super().on_schedule_end(context)
        self.primary_tier.clock.tick()

    def chunks_promoting(self, req_id: str) -> int | None:
        """How many of request `req_id`'s chunks are on their way up to the host tier
        (queued by this step's lookups, or in flight since an earlier step); None when
        one comes from a tier that cannot be waited for (one of vLLM's own)."""
        count = 0
        for tier_idx, by_request in self._pending_load_submissions.items():
            entry = by_request.get(req_id)
            if entry is not None:
                if not isinstance(self.secondary_tiers[tier_idx], KvswapSecondaryTier):
                    return None
                count += len(entry.keys)
        for tier_idx, job in self._promotions_of(req_id):
            if not isinstance(self.secondary_tiers[tier_idx], KvswapSecondaryTier):
                return None
            count += len(job.keys)
        return count

    def promote_now(self, req_id: str) -> int:
        """Submit the step's queued promotions now (vLLM would at the step's end), wait
        for `req_id`'s (`chunks_promoting` said kvswap's tiers hold them all), and take
        in what finished: the chunks a tier read are in the host tier, ready for a
        lookup; one it could not read (corrupt, gone) is not, and is recomputed.
        Returns how many of `req_id`'s chunks arrived."""
        self._flush_pending_promotions()
        arrived = 0
        for tier_idx, job in self._promotions_of(req_id):
            tier = self.secondary_tiers[tier_idx]
            assert isinstance(tier, KvswapSecondaryTier), "chunks_promoting said so"
            result = tier.wait_for(job.job_id)
            arrived += len(job.keys) if result.success else len(result.successful_keys or ())
        self._process_finished_jobs()
        return arrived

    def _promotions_of(self, req_id: str) -> list[tuple[int, Any]]:
        """(tier index, transfer job) of `req_id`'s promotions in flight."""
        return [
            (meta.tier_idx, meta.transfer_job)
            for meta in self._jobs.values()
            if meta.transfer_job.is_promotion and meta.transfer_job.req_context.req_id == req_id
        ]
