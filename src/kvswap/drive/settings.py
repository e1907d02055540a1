"""From the validated configuration to the control plane's plain settings, once.

The edge (engine, simulator, commands) validates a `KvSwapConfig`; this
module is the one place that reads it for the control plane, so that
`kvswap.control` never sees pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswap.base.identity import KeyNamespace
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.config import KvSwapConfig
from kvswap.config_capacities import TierCapacities
from kvswap.control.policy import PolicyOptions, check_policy_names
from kvswap.control.scheduler_records import Preemption, SchedulerSettings
from kvswap.control.settings import (
    DEFAULT_MAX_LOOKUP_BLOCKS,
    RemoteSettings,
    SwapSettings,
)
from kvswap.control.store_records import StoreLayout
from kvswap.errors import KvSwapError


@dataclass(frozen=True)
class ControlSettings:
    layout: StoreLayout
    policy: PolicyOptions
    swap: SwapSettings
    scheduler: SchedulerSettings
    # None: no remote tier configured (`tiers.remote_url` unset). Its `namespace` is
    # the key prefix the data plane's store client is built with.
    remote: RemoteSettings | None = None


def policy_options(config: KvSwapConfig) -> PolicyOptions:
    """The policy for a configuration: sink protection iff blocks are protected; each
    tier's eviction policy by name, resolved here once (a user's module is imported),
    so that a bad name is a one-line `ConfigError` before anything runs."""
    swap = config.swap
    options = PolicyOptions(
        sink_protection=swap.protected_sink_blocks > 0,
        min_residency_steps=swap.min_residency_steps,
        gpu_eviction_policy=swap.gpu_eviction_policy,
        cpu_eviction_policy=swap.cpu_eviction_policy,
        nvme_eviction_policy=swap.nvme_eviction_policy,
    )
    check_policy_names(options)
    return options


def remote_settings(
    config: KvSwapConfig,
    model_fingerprint: str,
    *,
    max_lookup_blocks: int | None = None,
    shared_store: bool = False,
) -> RemoteSettings | None:
    """The keyed tiers' control-plane settings; None when there is none: no store
    configured (`tiers.remote_url`), none brought by the caller (`shared_store`: the
    simulator's modelled one, `--shared-remote-gib`, tiers of one's own, the NVMe
    slab: a keyed tier of this process). The namespace defaults
    to the model fingerprint, which names the weights too: two checkpoints of one
    architecture never share a key prefix."""
    tiers = config.tiers
    if tiers.remote_url is None and not shared_store:
        return None
    return RemoteSettings(
        namespace=tiers.remote_namespace or model_fingerprint,
        write_policy=RemoteWritePolicy(tiers.remote_write_policy),
        max_lookup_blocks=(
            max_lookup_blocks if max_lookup_blocks is not None else DEFAULT_MAX_LOOKUP_BLOCKS
        ),
        max_inflight_write_chunks=tiers.remote_max_inflight_chunks,
    )


def control_settings(
    config: KvSwapConfig,
    capacities: TierCapacities,
    *,
    block_bytes: int,
    model_fingerprint: str,
    policy: PolicyOptions | None = None,
    max_sequence_tokens: int | None = None,
    remote_max_lookup_blocks: int | None = None,
    shared_store: bool = False,
) -> ControlSettings:
    """Everything the control plane is built with; `policy` overrides the config's
    (the simulator's findings compare policies on one configuration).
    `max_sequence_tokens` is the model's maximum position (the engine passes
    `arch.max_position_tokens`): longer requests are rejected at admission.
    `model_fingerprint` names the model's blocks (its weights included: pass
    `ModelDescription.fingerprint(weights=...)`); it roots every block key and is
    the remote store's default namespace. `remote_max_lookup_blocks` bounds the
    keys of one remote lookup call, a page (default `DEFAULT_MAX_LOOKUP_BLOCKS`);
    `shared_store`: the caller brings a remote store the config names no URL for
    (see `remote_settings`)."""
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
        remote=remote_settings(
            config,
            model_fingerprint,
            max_lookup_blocks=remote_max_lookup_blocks,
            shared_store=shared_store or capacities.num_nvme_blocks > 0,
        ),
    )
