"""The engine's settings: one frozen record, built once at the edge.

    a command's flags --> EngineOptions --.
                                          +--> engine_settings() --> EngineSettings --> Engine,
    the validated KvSwapConfig -----------'                                              the server

`engine_settings` is the one place that reads the validated configuration for
the engine. It resolves the model (architecture, block layout, the fingerprint
its blocks are named by), sizes the tiers in its blocks, and builds the control
plane's settings with `kvswap.drive.settings.control_settings`, as the
simulator does. Every check that needs no allocation runs here; `Engine` and
the server's engine thread read only the record, never the pydantic
configuration or a command's flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from kvswap.config import KvSwapConfig
from kvswap.config_capacities import TierCapacities, validate_capacities
from kvswap.data.layout import KVLayout
from kvswap.drive.settings import ControlSettings, control_settings
from kvswap.engine.device_tier import device_tier_blocks
from kvswap.errors import ConfigError, KvSwapError
from kvswap.import_path import import_object
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.kv_identity import kvswap_identity
from kvswap.model.loader import PRESET_SEED, resolve_model
from kvswap.model.weights_identity import weights_identity

if TYPE_CHECKING:
    from kvswap.data.remote_copy import TierFactory


#: The shortest useful context: one prompt token and one generated token. Below it a
#: server would start, then refuse every request.
MIN_MODEL_LEN_TOKENS = 2


def check_model_len(max_model_len: int, max_positions: int | None = None) -> None:
    """`--max-model-len` (vLLM's name): a request's prompt + output at most, within the
    model's maximum position (None: not known yet, as when the flags are first read)."""
    top = "" if max_positions is None else f"..{max_positions}"
    if max_model_len < MIN_MODEL_LEN_TOKENS or (
        max_positions is not None and max_model_len > max_positions
    ):
        known = "" if max_positions is None else f", within the maximum position {max_positions}"
        raise KvSwapError(
            f"--max-model-len {max_model_len}: a request needs at least one prompt token and "
            f"one new token{known}; allowed: {MIN_MODEL_LEN_TOKENS}{top or ' or more'}"
        )


@dataclass(frozen=True)
class EngineOptions:
    """What a command says beyond the configuration: the model (a preset's name or a
    checkpoint directory, `kvswap.model.choice`), its dtype (None: the checkpoint's),
    and the threads for the model on a CPU device (None: OMP_NUM_THREADS when the
    user set it, else every core, `kvswap.openmp_env.model_threads`; the copy
    workers sleep while idle, and the command line makes idle OpenMP threads sleep
    too, `kvswap.openmp_env`, so a copy finds a free core). `secondary_tiers`: tiers
    of one's own, key-addressed, fastest first, each a factory called once the pinned
    pool exists (`kvswap.data.tiers.base`); they go below the Redis store of
    `remote_url` when one is set, and need no URL (the `remote_*` write settings
    apply to them all; `kvswap.data.tiers.tier_list`)."""

    model: str = "small"
    dtype: str | None = None
    cpu_threads: int | None = None
    secondary_tiers: tuple[TierFactory, ...] = ()
    # vLLM's names: a request's prompt + output at most (None: the model's maximum
    # position), and the device tier as a share of the device's memory (None: the
    # configured GPU tier; `kvswap.engine.device_tier`).
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class NvmeSlabSettings:
    directory: Path
    persist: bool  # keep the slab file when the engine closes (`nvme_persist`)


@dataclass(frozen=True)
class RemoteStoreSettings:
    """The data plane's side of the remote tier (`tiers.remote_*`); the control plane's
    side is `ControlSettings.remote`, whose key namespace this repeats."""

    url: str
    namespace: str
    timeout_ms: float
    ttl_s: float
    max_inflight_chunks: int
    required: bool  # a store unreachable at start is an error (else a warning, tier off)


@dataclass(frozen=True)
class EngineSettings:
    options: EngineOptions
    device: str  # "auto" | "cpu" | "cuda"
    batch_invariant: bool  # the exact mode (`kvswap.model.llama`)
    arch: ModelArchConfig  # the model, in the dtype its weights and KV are held in
    layout: KVLayout
    capacities: TierCapacities
    prefetch_stream_count: int
    nvme: NvmeSlabSettings | None  # None: no NVMe tier
    remote_store: RemoteStoreSettings | None  # None: no store of `remote_url`
    # Below the store, fastest first: `tiers.secondary_tiers`, then `options.secondary_tiers`.
    secondary_tiers: tuple[TierFactory, ...]
    control: ControlSettings


def engine_settings(config: KvSwapConfig, options: EngineOptions) -> EngineSettings:
    """The engine's settings for `options` under `config`; a one-line error for a model
    or a tier that cannot be (the model's config.json and its weights' identity are
    read; no weight is loaded, nothing is allocated)."""
    engine, tiers = config.engine, config.tiers
    arch, _, _ = resolve_model(options.model, options.dtype)
    layout = KVLayout.for_model(arch.description, config.cache.kv_block_tokens)
    capacities = _capacities(config, options, arch, layout.block_bytes)
    secondary_tiers = (*map(tier_factory, config.tiers.secondary_tier_paths),
                       *options.secondary_tiers)  # fmt: skip
    max_sequence_tokens = arch.max_position_tokens
    if options.max_model_len is not None:
        check_model_len(options.max_model_len, arch.max_position_tokens)
        max_sequence_tokens = options.max_model_len
    identity = kvswap_identity(
        arch, weights_identity(options.model, preset_seed=PRESET_SEED),
        batch_invariant=engine.batch_invariant, device_type=pick_device(engine.device).type,
        block_tokens=layout.block_tokens, block_bytes=layout.block_bytes,
    )  # fmt: skip
    control = control_settings(
        config, capacities, block_bytes=layout.block_bytes,
        model_fingerprint=identity.fingerprint(),
        max_sequence_tokens=max_sequence_tokens,
        shared_store=bool(secondary_tiers),
    )  # fmt: skip
    nvme = None
    if capacities.num_nvme_blocks:
        assert tiers.nvme_dir is not None  # validated with the capacities
        nvme = NvmeSlabSettings(Path(tiers.nvme_dir), tiers.nvme_persist)
    remote_store = None
    if tiers.remote_url is not None:
        assert control.remote is not None  # the control plane's remote tier includes it
        remote_store = RemoteStoreSettings(
            url=tiers.remote_url, namespace=control.remote.namespace,
            timeout_ms=tiers.remote_timeout_ms, ttl_s=tiers.remote_ttl_s,
            max_inflight_chunks=tiers.remote_max_inflight_chunks,
            required=tiers.remote_required,
        )  # fmt: skip
    return EngineSettings(
        options=options,
        device=engine.device,
        batch_invariant=engine.batch_invariant,
        arch=arch,
        layout=layout,
        capacities=capacities,
        prefetch_stream_count=config.swap.prefetch_stream_count,
        nvme=nvme,
        remote_store=remote_store,
        secondary_tiers=secondary_tiers,
        control=control,
    )


def tier_factory(path: str) -> TierFactory:
    """The factory an entry of `tiers.secondary_tiers` names (imported here, at the edge),
    refused in one line if it names nothing callable."""
    allowed = "package.module:factory, called as factory(host_slots, layout)"
    found = import_object("secondary_tiers", path, allowed)
    if not callable(found):
        what = "nothing" if found is None else f"a {type(found).__name__}"
        raise ConfigError(
            f"secondary_tiers = {path!r}: {path.replace(':', '.')} is {what}, not callable; "
            f"allowed: {allowed}"
        )
    return cast("TierFactory", found)


def _capacities(
    config: KvSwapConfig, options: EngineOptions, arch: ModelArchConfig, block_bytes: int
) -> TierCapacities:
    """The tiers in blocks: as configured, or the device tier from
    `--gpu-memory-utilization` (then the configuration must leave it unset)."""
    capacities = config.tier_capacities(block_bytes)
    utilization = options.gpu_memory_utilization
    if utilization is None:
        return capacities
    if capacities.gpu_is_configured:
        raise KvSwapError(
            "--gpu-memory-utilization and a GPU tier size (gpu_kv_capacity_blocks/_bytes) "
            "both size the device tier; give one"
        )
    num_gpu_blocks = device_tier_blocks(
        utilization, arch, block_bytes, cuda=pick_device(config.engine.device).type == "cuda"
    )
    sized = dataclasses.replace(capacities, num_gpu_blocks=num_gpu_blocks, gpu_is_configured=True)
    validate_capacities(config.sized_rules(), sized)
    return sized


def pick_device(name: str) -> torch.device:
    """The device `engine.device` names ("auto": CUDA when present, else the CPU)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise KvSwapError("device = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
