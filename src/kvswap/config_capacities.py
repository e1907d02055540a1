"""Tier capacities in blocks, from the configuration, and the rules that need them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvswap.errors import ConfigError


@dataclass(frozen=True)
class TierCapacities:
    """Blocks per tier; `gpu_is_configured` is False when the GPU tier was left unset."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    num_nvme_blocks: int
    gpu_is_configured: bool


@dataclass(frozen=True)
class SizedRules:
    """The configuration's fields whose allowed values depend on the tiers' sizes."""

    protected_sink_blocks: int
    swap_out_chunk_blocks: int
    swap_in_chunk_blocks: int
    nvme_dir: Path | str | None


def validate_capacities(
    rules: SizedRules, capacities: TierCapacities, *, slab_needed: bool = True
) -> None:
    """Rules that need block counts: chunk vs tier sizes, protected blocks vs GPU tier,
    and (when `slab_needed`) an NVMe tier needs the directory of its slab."""
    # Protected blocks as many as the GPU tier leave no block for anything else: every
    # request would be rejected, so at least one block must stay unprotected.
    if capacities.num_gpu_blocks and rules.protected_sink_blocks >= capacities.num_gpu_blocks:
        raise ConfigError(
            f"protected_sink_blocks = {rules.protected_sink_blocks}: the GPU tier holds only "
            f"{capacities.num_gpu_blocks} blocks and one must stay unprotected; "
            f"allowed: 0..{capacities.num_gpu_blocks - 1}"
        )
    if capacities.num_gpu_blocks and rules.swap_out_chunk_blocks > capacities.num_gpu_blocks:
        raise ConfigError(
            f"swap_out_chunk_blocks = {rules.swap_out_chunk_blocks}: larger than the GPU tier it "
            f"moves from ({capacities.num_gpu_blocks} blocks); allowed: "
            f"1..{capacities.num_gpu_blocks}"
        )
    if capacities.num_cpu_blocks and rules.swap_in_chunk_blocks > capacities.num_cpu_blocks:
        raise ConfigError(
            f"swap_in_chunk_blocks = {rules.swap_in_chunk_blocks}: larger than the CPU tier it "
            f"moves from ({capacities.num_cpu_blocks} blocks); allowed: "
            f"1..{capacities.num_cpu_blocks}"
        )
    if slab_needed and capacities.num_nvme_blocks and rules.nvme_dir is None:
        raise ConfigError(
            f"nvme_kv_capacity_blocks = {capacities.num_nvme_blocks} needs nvme_dir, the directory "
            "that holds the NVMe slab; set nvme_dir or make the NVMe tier 0"
        )


def tier_blocks(
    tier: str, num_blocks: int | None, size_bytes: int | str | None, block_bytes: int
) -> int | None:
    """A tier's blocks, given in blocks or in bytes (not both); None: left unset.
    `size_bytes` is a validated size field (its validator made it an int)."""
    if num_blocks is not None and size_bytes is not None:
        raise ConfigError(
            f"{tier}_kv_capacity_blocks and {tier}_kv_capacity_bytes are both set; give one"
        )
    if size_bytes is not None:
        return int(size_bytes) // block_bytes
    return num_blocks
