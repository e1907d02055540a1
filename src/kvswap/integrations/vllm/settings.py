"""kvswap's knobs in vLLM's `kv_connector_extra_config`, validated once and frozen.

vLLM hands its offloading spec one untyped dict. The keys vLLM reads itself
(`cpu_bytes_to_use`, `block_size`, `blocks_per_chunk`, `spec_name`, ...) stay
vLLM's; kvswap's keep kvswap's names and kvswap's validation
(`kvswap.config_load.config_from_values`), so a bad value is the one-line
`ConfigError` kvswap gives everywhere, naming the key, the value and what is
allowed (types strict: the dict is JSON, so "8" is no count). A key that is
neither kvswap's nor one vLLM reads (`VLLM_KEYS`) is refused the same way: a
misspelt one would do nothing. The host tier's policy is named by vLLM's own
key, `eviction_policy`, with kvswap's name table (`kvswap.control.policy`):
"reuse" (the default), "kvswap", "lru", "arc", or an import path "package.module:ClassName".

vLLM-free: the spec calls `adapter_settings` with the dict vLLM gave it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvswap.base.eviction_policy import PolicyOptions
from kvswap.config import FIELD_SPELLINGS
from kvswap.config_load import config_from_values, suggest
from kvswap.control.policy import policy_class
from kvswap.errors import ConfigError

#: Where the values come from, as an error names it.
SOURCE = "kv_connector_extra_config"
#: kvswap's connector (connector.py) in vLLM's `kv_transfer_config`: the names vLLM
#: loads it by, beside "kv_role" and "kv_connector_extra_config".
KVSWAP_CONNECTOR = {
    "kv_connector": "KvswapConnector",
    "kv_connector_module_path": "kvswap.integrations.vllm",
}
#: The key naming the host tier's policy (vLLM's name for it).
POLICY_KEY = "eviction_policy"
#: The host tier's ranking unless `eviction_policy` names another: kvswap's reuse
#: ranking (control/policy_reuse.py), with its admission (docs/benchmarks.md).
DEFAULT_HOST_POLICY = "reuse"
#: kvswap's settings the adapter reads, under kvswap's names.
ADAPTER_FIELDS = (
    "protected_sink_blocks",
    "min_residency_steps",
    "swap_in_chunk_blocks",
    "swap_out_chunk_blocks",
    "prefetch_stream_count",
    "nvme_dir",
    "nvme_kv_capacity_bytes",
    "nvme_eviction_policy",
    "remote_url",
    "remote_namespace",
    "remote_timeout_ms",
    "remote_ttl_s",
    "remote_max_inflight_chunks",
    "remote_required",
)
#: The keys vLLM's offloading connector, spec and tiering read from the same dict
#: (vLLM 0.32 and 0.33), left to vLLM; `locality` is a secondary tier entry's key
#: that vLLM passes on to the tier (`KvswapNvmeTier`, ...) with kvswap's.
VLLM_KEYS = frozenset(
    {
        "spec_name", "spec_module_path",  # OffloadingSpecFactory
        "block_size", "blocks_per_chunk", "canonical_layout",  # the connector's config
        "sync_load_budget_bytes",  # the connector's scheduler (0.33; KvswapConnector on 0.32)
        "offload_prompt_only", "self_describing_kv_events",  # OffloadingSpec
        "cpu_bytes_to_use", POLICY_KEY, "cache_policy_module_path",  # CPUOffloadingSpec
        "store_threshold", "max_tracker_size",
        "secondary_tiers", "tier_poll_interval_s", "backpressure",  # TieringOffloadingSpec
        "locality",  # a secondary tier's entry
    }
)  # fmt: skip


@dataclass(frozen=True)
class NvmeSettings:
    """kvswap's NVMe slab as a secondary tier below vLLM's host tier."""

    directory: Path
    capacity_bytes: int
    eviction_policy: str


@dataclass(frozen=True)
class RemoteSettings:
    """kvswap's Redis-protocol store as a secondary tier. `url` may hold a password:
    it is parsed (and masked in every message) by `kvswap.data.remote_url`."""

    url: str
    namespace: str | None
    timeout_ms: float
    ttl_s: float
    max_inflight_chunks: int
    required: bool


@dataclass(frozen=True)
class AdapterSettings:
    """What the adapter is built with. Host-tier blocks are vLLM's offloaded chunks
    (`blocks_per_chunk` GPU blocks, 1 by default): `protected_sink_blocks` and the
    chunk sizes count them."""

    policy_name: str  # the host tier's policy (`eviction_policy`)
    policy: PolicyOptions  # its switches: sinks, residency
    protected_sink_blocks: int
    swap_in_chunk_blocks: int
    swap_out_chunk_blocks: int
    prefetch_stream_count: int
    nvme: NvmeSettings | None
    remote: RemoteSettings | None
    # vLLM's own `secondary_tiers` entries (top-level `backpressure` merged in, as
    # vLLM's TieringOffloadingSpec does), below kvswap's NVMe slab and store.
    vllm_tiers: tuple[Mapping[str, Any], ...] = ()
    tier_poll_interval_s: float | None = None  # vLLM 0.33's tiering manager's; None: its default

    @property
    def has_secondary_tiers(self) -> bool:
        return self.nvme is not None or self.remote is not None or bool(self.vllm_tiers)


def adapter_settings(extra_config: Mapping[str, Any]) -> AdapterSettings:
    """kvswap's keys of `extra_config`, validated; ConfigError in one line otherwise,
    for a key neither kvswap's adapter nor vLLM reads, too (a misspelt key would do
    nothing) and for a value of the wrong type ("8" for a count)."""
    _check_keys(extra_config)
    _both_or_neither(extra_config, "nvme_dir", "nvme_kv_capacity_bytes")
    sync_load_budget_bytes(extra_config)  # the connector's key, checked with the rest
    policy_name = extra_config.get(POLICY_KEY, DEFAULT_HOST_POLICY)
    if not isinstance(policy_name, str):
        raise ConfigError(
            f"{POLICY_KEY} = {policy_name!r} ({SOURCE}): not a name; allowed: 'reuse', "
            "'kvswap', 'lru', 'arc', or an import path 'package.module:ClassName'"
        )
    vllm_tiers = _vllm_tiers(extra_config)
    tier_poll_interval_s = _poll_interval(extra_config.get("tier_poll_interval_s"))
    values = {key: extra_config[key] for key in ADAPTER_FIELDS if key in extra_config}
    config = config_from_values(values, SOURCE)
    swap, tiers, cache = config.swap, config.tiers, config.cache
    # Both policy names resolved now: a bad name or import is one line before anything runs.
    policy_class(POLICY_KEY, policy_name, top=True)
    policy_class("nvme_eviction_policy", swap.nvme_eviction_policy, top=False)
    nvme_bytes = int(cache.nvme_kv_capacity_bytes or 0)  # the slab: a directory and a size > 0
    return AdapterSettings(
        policy_name=policy_name,
        policy=PolicyOptions(
            sink_protection=swap.protected_sink_blocks > 0,
            min_residency_steps=swap.min_residency_steps,
        ),
        protected_sink_blocks=swap.protected_sink_blocks,
        swap_in_chunk_blocks=swap.swap_in_chunk_blocks,
        swap_out_chunk_blocks=swap.swap_out_chunk_blocks,
        prefetch_stream_count=swap.prefetch_stream_count,
        nvme=None
        if tiers.nvme_dir is None or nvme_bytes == 0
        else NvmeSettings(Path(tiers.nvme_dir), nvme_bytes, swap.nvme_eviction_policy),
        remote=None
        if tiers.remote_url is None
        else RemoteSettings(
            url=tiers.remote_url,
            namespace=tiers.remote_namespace,
            timeout_ms=tiers.remote_timeout_ms,
            ttl_s=tiers.remote_ttl_s,
            max_inflight_chunks=tiers.remote_max_inflight_chunks,
            required=tiers.remote_required,
        ),
        vllm_tiers=vllm_tiers,
        tier_poll_interval_s=tier_poll_interval_s,
    )


_TIER_ENTRIES = (
    "a list of vLLM secondary tier entries, each a dict with a 'type' (vLLM's 'fs', 'obj', "
    "..., or a class name with 'module_path')"
)


def _vllm_tiers(extra_config: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """vLLM's `secondary_tiers` entries, checked in one line each, with the top-level
    `backpressure` merged into each field by field (an entry's own fields win)."""
    entries = extra_config.get("secondary_tiers", [])
    if not isinstance(entries, list):
        raise ConfigError(f"secondary_tiers = {entries!r:.80} ({SOURCE}); allowed: {_TIER_ENTRIES}")
    for index, entry in enumerate(entries):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("type"), str)
            or not entry["type"]
        ):
            raise ConfigError(
                f"secondary_tiers[{index}] = {entry!r:.80} ({SOURCE}); allowed: {_TIER_ENTRIES}"
            )
    defaults = extra_config.get("backpressure")
    if defaults is not None and not isinstance(defaults, dict):
        raise ConfigError(f"backpressure = {defaults!r:.80} ({SOURCE}); allowed: a dict")
    if defaults is not None and not entries:
        raise ConfigError(
            f"backpressure ({SOURCE}) applies to vLLM's secondary_tiers entries and none is "
            "given; allowed: with secondary_tiers, or not at all"
        )
    resolved = []
    for entry in entries:
        entry = dict(entry)
        merged = {**(defaults or {}), **(entry.get("backpressure") or {})}
        if merged or "backpressure" in entry:
            entry["backpressure"] = merged
        resolved.append(entry)
    return tuple(resolved)


def sync_load_budget_bytes(extra_config: Mapping[str, Any]) -> int:
    """`sync_load_budget_bytes` (vLLM 0.33's key, which `KvswapConnector` also reads on
    0.32): the bytes a step may load before its forward pass; 0, the default: none."""
    value = extra_config.get("sync_load_budget_bytes", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"sync_load_budget_bytes = {value!r:.80} ({SOURCE}); allowed: a whole number of "
            "bytes >= 0 (0: every load between steps)"
        )
    return value


def _poll_interval(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"tier_poll_interval_s = {value!r:.80} ({SOURCE}); allowed: a number of seconds"
        )
    return float(value)


def _check_keys(extra_config: Mapping[str, Any]) -> None:
    """Every key is one the adapter or vLLM reads; one line naming the first that is not."""
    for key in extra_config:
        if key in ADAPTER_FIELDS or key in VLLM_KEYS:
            continue
        kvswap_keys = f"kvswap's {', '.join(ADAPTER_FIELDS)}"
        if key in FIELD_SPELLINGS:
            raise ConfigError(
                f"{SOURCE}: {key!r} is a setting of kvswap's own engine, which vLLM's "
                f"adapter does not use; allowed here: {kvswap_keys} (and vLLM's own keys)"
            )
        known = [*ADAPTER_FIELDS, *sorted(VLLM_KEYS)]
        raise ConfigError(
            f"{SOURCE}: unknown key {key!r}{suggest(str(key), known)}; allowed: "
            f"{kvswap_keys}; vLLM's {', '.join(sorted(VLLM_KEYS))}"
        )


def _both_or_neither(extra_config: Mapping[str, Any], first: str, second: str) -> None:
    """A slab directory without a size (or a size without a directory) would be
    ignored without a word: refused in one line."""
    if (first in extra_config) != (second in extra_config):
        given, missing = (first, second) if first in extra_config else (second, first)
        raise ConfigError(
            f"{SOURCE}: {given} is set but {missing} is not; allowed: both (an NVMe tier "
            "below the host tier) or neither"
        )
