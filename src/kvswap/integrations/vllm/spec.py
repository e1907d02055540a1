"""`KvswapOffloadingSpec`: what vLLM's offloading connector loads by name.

    kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvswapOffloadingSpec",
            "spec_module_path": "kvswap.integrations.vllm", "cpu_bytes_to_use": ..., ...}}

vLLM builds one spec in the scheduler (`get_manager`) and one in each worker
(`get_worker`). The host tier is sized exactly as vLLM's own CPU spec sizes it
(this class is a `CPUOffloadingSpec`: `num_chunks` chunks from
`cpu_bytes_to_use`); kvswap's settings come from the same dict
(`settings.py`). Unlike vLLM's CPU spec it runs on the CPU platform too: its
worker copies with kvswap's engine, which has a CPU path.

With secondary tiers the host pool is one file in /dev/shm that the worker and
the scheduler both map (`host_file.py`), since vLLM runs them in different
processes and the tiers, in the scheduler, read and write its rows. That needs
one worker: a tensor- or pipeline-parallel run is refused.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvswap.data.remote_url import parse_remote_url
from kvswap.errors import ConfigError, KvSwapError
from kvswap.integrations.vllm.cache_policy import HostRanking, KvswapCachePolicy
from kvswap.integrations.vllm.connector import loads_within_step_read
from kvswap.integrations.vllm.host_file import (
    host_file_path,
    refusing_a_shared_engine_id,
    sweep_host_files,
)
from kvswap.integrations.vllm.host_report import LOGGER, HostReport, metric_definitions
from kvswap.integrations.vllm.manager import (
    KvswapHostManager,
    KvswapPrimaryTier,
    KvswapTieringManager,
    SharedHostRows,
)
from kvswap.integrations.vllm.settings import SOURCE, adapter_settings, sync_load_budget_bytes
from kvswap.integrations.vllm.tiers import build_secondary_tiers, build_vllm_tiers, tier_counters
from kvswap.integrations.vllm.worker import KvswapOffloadingWorker
from kvswap.units import format_bytes


@functools.cache
def _warn_budget_ignored() -> None:
    """Once a process (the scheduler's spec and the worker's may share one)."""
    LOGGER.warning(
        "kvswap: sync_load_budget_bytes is read by vLLM 0.33's connector and by "
        'kvswap\'s ("kv_connector": "KvswapConnector", "kv_connector_module_path": '
        '"kvswap.integrations.vllm"); this vLLM\'s OffloadingConnector ignores it: '
        "every load goes between steps"
    )


class KvswapOffloadingSpec(CPUOffloadingSpec):
    """vLLM's offloading spec: kvswap's ranking, copy engine and secondary tiers."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's metrics for what this spec builds: with secondary tiers, its tiering
        manager's too (vLLM refuses to record a metric its spec did not declare)."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata

        kvswap = metric_definitions(OffloadingCounterMetadata)
        if adapter_settings(extra_config).has_secondary_tiers:
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

            definitions: dict[str, Any] = TieringOffloadingSpec.build_metric_definitions(
                extra_config
            )
            return {**definitions, **kvswap}
        return {**super().build_metric_definitions(extra_config), **kvswap}

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # vLLM's sizing: num_chunks, cpu_page_size_per_worker
        self._manager: Any = None  # built on first use, as vLLM's spec does
        self._worker: KvswapOffloadingWorker | None = None
        self.settings = adapter_settings(self.extra_config)
        if len(self.tokens_per_block) != 1:
            raise KvSwapError(
                f"kvswap's vLLM adapter supports one KV cache group, got "
                f"{len(self.tokens_per_block)} (hybrid models are not supported)"
            )
        self.tokens_per_chunk = self.tokens_per_block[0] * self.blocks_per_chunk
        if sync_load_budget_bytes(self.extra_config) and not loads_within_step_read():
            _warn_budget_ignored()
        if self.settings.has_secondary_tiers and config.parallel.world_size != 1:
            raise KvSwapError(
                f"{SOURCE}: nvme_dir / remote_url / secondary_tiers need one vLLM worker (the "
                f"scheduler's tiers share its host pool), got {config.parallel.world_size}; "
                "allowed: tensor_parallel_size = pipeline_parallel_size = 1, or no secondary tier"
            )

    @property
    def row_bytes(self) -> int:
        """One host chunk of one worker, exactly (no alignment padding)."""
        return int(self.cpu_page_size_per_worker)

    @property
    def shared_path(self) -> Path | None:
        """The host pool's file while the worker and the scheduler both map it; None
        without secondary tiers (the worker's pool is its own)."""
        if not self.settings.has_secondary_tiers:
            return None
        return host_file_path(self.config.engine_id)

    def get_manager(self) -> Any:
        if self._manager is None:
            self._check_size()
            self._manager = self._build_manager()
        return self._manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            self._check_size()
            path = self._swept_shared_path()
            with refusing_a_shared_engine_id(self.config.engine_id):
                self._worker = KvswapOffloadingWorker(
                    kv_caches,
                    blocks_per_chunk=self.blocks_per_chunk,
                    num_chunks=self.num_chunks,
                    row_bytes=self.row_bytes,
                    settings=self.settings,
                    shared_path=path,
                )
        return self._worker

    def _swept_shared_path(self) -> Path | None:
        """`shared_path`, after removing the host files of killed starts (any engine)."""
        path = self.shared_path
        if path is not None:
            sweep_host_files(path.parent)
        return path

    def _build_manager(self) -> Any:
        settings = self.settings
        tiers: list[Any] = []
        report = HostReport(
            self.num_chunks, self.kv_bytes_per_chunk,
            tiers=lambda: [(tier.tier_type, tier_counters(tier)) for tier in tiers],
        )  # fmt: skip
        policy = KvswapCachePolicy(
            self.num_chunks,
            HostRanking(
                policy_name=settings.policy_name,
                options=settings.policy,
                protected_sink_blocks=settings.protected_sink_blocks,
                tokens_per_chunk=self.tokens_per_chunk,
            ),
        )
        enable_events = self.kv_events_config.enable_kv_cache_events
        # vLLM 0.33's managers also take the tier's static facts (`info`); 0.32's do not.
        extras = {"info": self.cpu_info} if hasattr(self, "cpu_info") else {}
        path = self._swept_shared_path()
        if path is None:
            report.log_start(self._ranking_text(), ())
            return KvswapHostManager(
                self.num_chunks, policy, report, enable_events=enable_events, **extras
            )
        with refusing_a_shared_engine_id(self.config.engine_id):
            rows = SharedHostRows(path, self.num_chunks, self.row_bytes)
        try:
            primary = KvswapPrimaryTier(
                self.num_chunks, rows, policy, report, enable_events=enable_events, **extras
            )
            view = primary.get_kv_memoryview()
            tiers += build_secondary_tiers(self, view, policy.copied_below)
            tiers += build_vllm_tiers(self, view, settings.vllm_tiers, policy.copied_below)
            manager = KvswapTieringManager(
                primary_tier=primary, secondary_tiers=tiers, **self._manager_options()
            )
        except BaseException:
            for tier in reversed(tiers):
                tier.shutdown()
            rows.cleanup()
            raise
        report.log_start(self._ranking_text(), self._tiers_below_text())
        return manager

    def _manager_options(self) -> dict[str, Any]:
        """vLLM 0.33's tiering manager's `tier_poll_interval_s`, when set; refused in one
        line by a vLLM whose manager has none (0.32), where it would do nothing."""
        interval = self.settings.tier_poll_interval_s
        if interval is None:
            return {}
        if "tier_poll_interval_s" not in inspect.signature(KvswapTieringManager).parameters:
            raise ConfigError(
                f"tier_poll_interval_s = {interval} ({SOURCE}): this vLLM's tiering manager "
                "polls its tiers every step and takes no interval (vLLM 0.33 does); allowed: "
                "leave it unset"
            )
        return {"tier_poll_interval_s": interval}

    def _ranking_text(self) -> str:
        """How the host tier is ranked, for the start-up line."""
        settings = self.settings
        return (
            f"policy {settings.policy_name}, sinks "
            f"{settings.protected_sink_blocks} chunks, residency "
            f"{settings.policy.min_residency_steps} steps"
        )

    def _tiers_below_text(self) -> list[str]:
        """The secondary tiers, for the start-up line (a store's password masked)."""
        below = []
        if (nvme := self.settings.nvme) is not None:
            below.append(
                f"NVMe {nvme.directory} {format_bytes(nvme.capacity_bytes)} "
                f"(policy {nvme.eviction_policy})"
            )
        if (remote := self.settings.remote) is not None:
            below.append(f"store {parse_remote_url(remote.url).shown}")
        below += [f"vLLM's {entry['type']!r} tier" for entry in self.settings.vllm_tiers]
        return below

    def _check_size(self) -> None:
        if self.num_chunks < 1:
            raise KvSwapError(
                f"{SOURCE}: cpu_bytes_to_use = {self.extra_config.get('cpu_bytes_to_use')!r} "
                f"holds no host chunk of {self.kv_bytes_per_chunk} bytes; allowed: at least one"
            )
