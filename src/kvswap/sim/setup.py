"""From a configuration and a hardware profile to sized, checked tiers.

Model shapes come from the ledger (a preset or an HF config.json), never from
a torch model. A GPU tier left unset in the config is filled from the
hardware: (GPU memory - weights - reserve) / block bytes, as `kvswap plan`
does. A configuration the hardware cannot hold fails here, before anything
is simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvswap.config import KvSwapConfig
from kvswap.config_capacities import TierCapacities, validate_capacities
from kvswap.errors import ConfigError
from kvswap.ledger import kv_bytes_per_block
from kvswap.model.description import ModelDescription
from kvswap.model.dtypes import dtype_bytes
from kvswap.model.presets import describe_model
from kvswap.sim.hardware import HardwareProfile
from kvswap.units import format_bytes


@dataclass(frozen=True)
class SimSetup:
    config: KvSwapConfig
    shape: ModelDescription  # in `dtype`: block_fingerprint(shape, None) names its blocks
    dtype: str
    hardware: HardwareProfile
    block_bytes: int
    weights_bytes: int
    capacities: TierCapacities


def shape_of(config: KvSwapConfig) -> ModelDescription:
    """The [model] section's description, in the configured KV dtype."""
    shape = describe_model(config.model.preset, config.model.hf_config)
    return shape.with_kv_dtype(config.model.dtype)


def resolve_setup(
    config: KvSwapConfig, hardware: HardwareProfile, shape: ModelDescription | None = None
) -> SimSetup:
    """Size every tier for `config` on `hardware`; ConfigError if it cannot fit."""
    dtype = config.model.dtype
    shape = shape_of(config) if shape is None else shape.with_kv_dtype(dtype)
    block_bytes = kv_bytes_per_block(shape, dtype, config.cache.kv_block_tokens)
    if shape.num_params is None:
        raise ConfigError(
            f"model {shape.name!r}: the parameter count is unknown, so the weights' size and the "
            "step time cannot be modelled; use a preset or a config.json with its size fields"
        )
    weights = shape.num_params * dtype_bytes(dtype)
    capacities = config.tier_capacities(block_bytes)
    budget = hardware.gpu_mem_bytes - weights - hardware.gpu_reserve_bytes
    if not capacities.gpu_is_configured:
        capacities = dataclasses.replace(capacities, num_gpu_blocks=max(0, budget) // block_bytes)
        validate_capacities(config.sized_rules(), capacities)
    if capacities.num_gpu_blocks < 1:
        raise ConfigError(
            f"{hardware.name}: {format_bytes(hardware.gpu_mem_bytes)} of GPU memory leaves no room "
            f"for one KV block of {format_bytes(block_bytes)} after {shape.name}'s "
            f"{format_bytes(weights)} of weights and a {format_bytes(hardware.gpu_reserve_bytes)} "
            "reserve; pick bigger hardware or a smaller model"
        )
    gpu_kv = capacities.num_gpu_blocks * block_bytes
    if gpu_kv > budget:
        raise ConfigError(
            f"gpu_kv_capacity_blocks = {capacities.num_gpu_blocks} needs {format_bytes(gpu_kv)} "
            f"but {hardware.name} has {format_bytes(max(0, budget))} of GPU memory left after "
            f"weights ({format_bytes(weights)}) and reserve; allowed: "
            f"0..{max(0, budget) // block_bytes} blocks"
        )
    cpu_kv = capacities.num_cpu_blocks * block_bytes
    if cpu_kv > hardware.host_mem_bytes:
        raise ConfigError(
            f"cpu_kv_capacity_blocks = {capacities.num_cpu_blocks} needs {format_bytes(cpu_kv)} of "
            f"pinned memory but {hardware.name} has {format_bytes(hardware.host_mem_bytes)} of "
            f"RAM; allowed: 0..{hardware.host_mem_bytes // block_bytes} blocks"
        )
    return SimSetup(config, shape, dtype, hardware, block_bytes, weights, capacities)
