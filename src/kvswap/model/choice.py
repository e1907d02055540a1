"""Which model the engine runs: a flag, else what the configuration set, else a default.

    --model / --dtype          win when given
    [model] preset / dtype     set by a file or KVSWAP_* (not the defaults)
    default_model              `small` for run and serve, `tiny` for generate;
                               dtype None: the checkpoint's own (fp32 for a preset)

`[model]` describes a model for sizing (plan, simulate); the engine runs only
what it can load (an engine preset or a checkpoint directory) in a dtype it
computes in, so anything else is refused in one line that names the flag to use.
What a source then resolves to (its architecture, its checkpoint) is
`kvswap.model.loader.resolve_model`.

Torch-free: commands choose a model before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvswap.errors import KvSwapError
from kvswap.model.dtypes import WEIGHT_DTYPES
from kvswap.model.presets import ENGINE_PRESET_NAMES

#: The dtypes the engine computes in (a KV-only dtype such as fp8 is for sizing).
ENGINE_DTYPES = WEIGHT_DTYPES


class ModelChoice(NamedTuple):
    source: str  # an engine preset's name or a checkpoint directory
    dtype: str | None  # None: the checkpoint's own dtype (fp32 for a preset)


@dataclass(frozen=True)
class ConfiguredModel:
    """What a configuration file or KVSWAP_* variable set in `[model]`; None: not set
    there (a field left at its default names no model to run)."""

    preset: str | None = None
    hf_config: str | None = None
    dtype: str | None = None


def choose_engine_model(
    model_flag: str | None,
    dtype_flag: str | None,
    configured: ConfiguredModel,
    *,
    default_model: str,
) -> ModelChoice:
    """The model and dtype the engine runs (module docstring)."""
    model = model_flag if model_flag is not None else default_model
    if model_flag is None and configured.hf_config is not None:
        raise KvSwapError(
            f"[model] hf_config = {configured.hf_config!r}: `kvswap run` needs weights, "
            "not a config.json alone; use --model DIR (a checkpoint directory)"
        )
    if model_flag is None and configured.preset is not None:
        if configured.preset not in ENGINE_PRESET_NAMES:
            raise KvSwapError(
                f"[model] preset = {configured.preset!r}: `kvswap run` runs only "
                f"{', '.join(ENGINE_PRESET_NAMES)} or a checkpoint; use --model NAME|DIR "
                "(the other presets are for plan and simulate)"
            )
        model = configured.preset
    dtype = dtype_flag
    if dtype is None and configured.dtype is not None:
        if configured.dtype not in ENGINE_DTYPES:
            raise KvSwapError(
                f"[model] dtype = {configured.dtype!r}: the engine computes in "
                f"{', '.join(ENGINE_DTYPES)}; use --dtype {'|'.join(ENGINE_DTYPES)} "
                "(fp8 is for plan and simulate)"
            )
        dtype = configured.dtype
    return ModelChoice(model, dtype)
