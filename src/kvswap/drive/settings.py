"""From the validated configuration to the control plane's plain settings, once.

The edge (engine, simulator, commands) validates a `KvSwapConfig`; this
module is the one place that reads it for the control plane, so that
`kvswap.control` never sees pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswap.config import KvSwapConfig, TierCapacities
from kvswap.control.identity import KeyNamespace
from kvswap.control.policy import PolicyOptions
from kvswap.control.scheduler import Preemption, SchedulerSettings
from kvswap.control.settings import SwapSettings
from kvswap.control.store import StoreLayout
from kvswap.errors import KvSwapError


@dataclass(frozen=True)
class ControlSettings:
    layout: StoreLayout
    policy: PolicyOptions
    swap: SwapSettings
    scheduler: SchedulerSettings


def policy_options(config: KvSwapConfig) -> PolicyOptions:
    """The policy for a configuration: sink protection iff blocks are protected."""
    swap = config.swap
    return PolicyOptions(
        sink_protection=swap.protected_sink_blocks > 0,
        min_residency_steps=swap.min_residency_steps,
    )


def control_settings(
    config: KvSwapConfig,
    capacities: TierCapacities,
    *,
    block_bytes: int,
    model_fingerprint: str,
    policy: PolicyOptions | None = None,
    max_sequence_tokens: int | None = None,
) -> ControlSettings:
    """Everything the control plane is built with; `policy` overrides the config's
    (the simulator's findings compare policies on one configuration).
    `max_sequence_tokens` is the model's maximum position (the engine passes
    `arch.max_position_tokens`): longer requests are rejected at admission."""
    if max_sequence_tokens is not None and (
        isinstance(max_sequence_tokens, bool)
        or not isinstance(max_sequence_tokens, int)
        or max_sequence_tokens < 1
    ):
        raise KvSwapError(
            f"max_sequence_tokens = {max_sequence_tokens!r}: allowed: an integer >= 1, or none"
        )
    swap, engine = config.swap, config.engine
    block_tokens = config.cache.kv_block_tokens
    layout = StoreLayout(
        block_tokens=block_tokens,
        num_gpu_blocks=capacities.num_gpu_blocks,
        num_cpu_blocks=capacities.num_cpu_blocks,
        num_nvme_blocks=capacities.num_nvme_blocks,
        protected_blocks=swap.protected_sink_blocks,
        namespace=KeyNamespace(model_fingerprint=model_fingerprint, block_tokens=block_tokens),
    )
    return ControlSettings(
        layout=layout,
        policy=policy if policy is not None else policy_options(config),
        swap=SwapSettings(
            block_bytes=block_bytes,
            swap_out_high_watermark=swap.swap_out_high_watermark,
            swap_out_low_watermark=swap.swap_out_low_watermark,
            swap_out_chunk_blocks=swap.swap_out_chunk_blocks,
            swap_in_chunk_blocks=swap.swap_in_chunk_blocks,
            cpu_demote_high_watermark=swap.cpu_demote_high_watermark,
            cpu_demote_low_watermark=swap.cpu_demote_low_watermark,
        ),
        scheduler=SchedulerSettings(
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            preemption=Preemption(engine.preemption),
            max_sequence_tokens=max_sequence_tokens,
        ),
    )
