"""Write a configuration as TOML that `kvswap run --config` and `kvswap simulate
--config` read back unchanged: the seed article's flat key names for the cache,
watermark and transfer knobs, then the [model], [tiers], [engine] and
[simulator] sections. Tier sizes are written in blocks, as resolved for the
hardware (a GPU tier sized from the GPU's memory becomes explicit)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvswap.config import KvSwapConfig
from kvswap.config_capacities import TierCapacities

_FLAT_SWAP_KEYS = (
    "swap_out_high_watermark", "swap_out_low_watermark", "protected_sink_blocks",
    "min_residency_steps", "swap_out_chunk_blocks", "swap_in_chunk_blocks",
    "prefetch_stream_count", "cpu_demote_high_watermark", "cpu_demote_low_watermark",
    "gpu_eviction_policy", "cpu_eviction_policy", "nvme_eviction_policy",
)  # fmt: skip


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string for plain text and paths


def config_to_toml(
    config: KvSwapConfig,
    capacities: TierCapacities,
    *,
    header: Sequence[str] = (),
    notes: dict[str, str] | None = None,
) -> str:
    """The TOML text; `notes` adds a trailing comment to a flat key's line."""
    notes = notes or {}
    lines = [f"# {line}" for line in header]
    flat: list[tuple[str, object]] = [
        ("kv_block_tokens", config.cache.kv_block_tokens),
        ("gpu_kv_capacity_blocks", capacities.num_gpu_blocks),
        ("cpu_kv_capacity_blocks", capacities.num_cpu_blocks),
        ("nvme_kv_capacity_blocks", capacities.num_nvme_blocks),
    ]
    flat += [(key, getattr(config.swap, key)) for key in _FLAT_SWAP_KEYS]
    for key, value in flat:
        note = f"  # {notes[key]}" if key in notes else ""
        lines.append(f"{key} = {_value(value)}{note}")
    tiers = config.tiers.model_dump()
    if not capacities.num_nvme_blocks:
        # No NVMe tier, so no directory: one named without a tier is refused when read.
        tiers["nvme_dir"] = None
    sections = {
        "model": config.model.model_dump(),
        "tiers": tiers,
        "engine": config.engine.model_dump(),
        "simulator": config.simulator.model_dump(),
    }
    for name, values in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_value(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"
